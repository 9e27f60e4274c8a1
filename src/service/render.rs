//! Admin pages rendered one at a time and shared: a page that merges or encodes much (`/top`,
//! `/metrics`) is rendered on a blocking thread, never on the thread answering probes, by one
//! render at a time per page; the requests that come meanwhile wait for it and share its answer,
//! so that any number of clients cost one render's memory and one core at most.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Mutex;

/// The renders of one page, by what was asked: at most one running, the last few kept.
pub struct Renders<K, V> {
    /// How much older than a request a render it shares may be.
    fresh: Duration,
    /// Held through a render, by the blocking thread rendering: renders take turns, even when
    /// the request that started one is gone.
    kept: Arc<Mutex<Vec<Kept<K, V>>>>,
}

/// A render kept, and when it began.
struct Kept<K, V> {
    asked: K,
    began: Instant,
    page: V,
}

/// Renders kept for other questions than the last: a few distinct queries are served from
/// memory, and no query cycle can make them hold more.
const MOST_KEPT: usize = 4;

impl<K, V> Renders<K, V>
where
    K: PartialEq + Send + 'static,
    V: Clone + Send + 'static,
{
    /// Renders shared by the requests that arrive while one runs, and by those at most `fresh`
    /// after it began (zero: only those that wait for it, so an answer is never older than its
    /// request).
    pub fn new(fresh: Duration) -> Self {
        Renders {
            fresh,
            kept: Arc::default(),
        }
    }

    /// The page `asked`: a render that began at most `fresh` before this call, else a new one by
    /// `render` once the running one is done. `None` when the render panicked.
    pub async fn page(&self, asked: K, render: impl FnOnce() -> V + Send + 'static) -> Option<V> {
        let arrived = Instant::now();
        let mut kept = self.kept.clone().lock_owned().await;
        let fresh = self.fresh;
        if let Some(k) = kept
            .iter()
            .find(|k| k.asked == asked && k.began + fresh >= arrived)
        {
            return Some(k.page.clone());
        }
        let began = Instant::now();
        let rendered = tokio::task::spawn_blocking(move || {
            let page = render();
            kept.retain(|k| k.asked != asked);
            if kept.len() >= MOST_KEPT {
                kept.remove(0);
            }
            kept.push(Kept {
                asked,
                began,
                page: page.clone(),
            });
            page
        });
        rendered.await.ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test]
    async fn concurrent_requests_share_one_render_and_later_ones_get_a_new_one() {
        let renders = Arc::new(Renders::<(), usize>::new(Duration::ZERO));
        let count = Arc::new(AtomicUsize::new(0));
        let render = |count: Arc<AtomicUsize>| {
            move || {
                std::thread::sleep(Duration::from_millis(50));
                count.fetch_add(1, Ordering::SeqCst) + 1
            }
        };
        let asks: Vec<_> = (0..20)
            .map(|_| {
                let (renders, count) = (renders.clone(), count.clone());
                tokio::spawn(async move { renders.page((), render(count)).await })
            })
            .collect();
        let mut pages = Vec::new();
        for ask in asks {
            pages.push(ask.await.unwrap().unwrap());
        }
        // The first render, then one more for those that arrived while it ran.
        assert!(count.load(Ordering::SeqCst) <= 2, "{pages:?}");
        let after = renders.page((), render(count.clone())).await.unwrap();
        assert!(
            after > *pages.iter().max().unwrap(),
            "a later request sees a later render"
        );
    }

    #[tokio::test]
    async fn a_fresh_render_serves_its_question_and_only_the_last_few_are_kept() {
        let renders = Renders::<usize, usize>::new(Duration::from_secs(60));
        assert_eq!(renders.page(1, || 10).await, Some(10));
        assert_eq!(renders.page(1, || 11).await, Some(10), "still fresh");
        for asked in 2..=MOST_KEPT + 1 {
            assert_eq!(renders.page(asked, move || asked).await, Some(asked));
        }
        assert_eq!(renders.page(1, || 12).await, Some(12), "the oldest went");
        assert!(renders.kept.lock().await.len() <= MOST_KEPT);
    }
}
