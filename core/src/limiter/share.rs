//! Max-min fair division of a quota bucket's limit among the streams that report it, as Doorman's
//! FAIR_SHARE divides capacity among clients: no stream gets more than it asks while another that
//! asks more gets less than an equal part. What nobody asks for is spread evenly on top among the
//! streams that ask for some, so that a stream whose demand grows is not held at its last demand
//! until its next report; an idle stream keeps the least share, and what no stream asks for at
//! all is granted to none (a newcomer has it at once).

/// Demands and shares are counted in thousandths of a request per window.
pub const MILLI: u64 = 1000;

/// How much a grant must move to be changed: Envoy rebuilds a token bucket whose numbers change,
/// and a rebuilt bucket starts anew.
const SETTLED: u64 = 50;

/// Whether a stream granted `grant` keeps it while its share is `share`: while they differ by 2 %
/// of the grant or less, so that noise in the reports does not make Envoy rebuild its bucket at
/// every report.
pub fn settled(grant: u64, share: u64) -> bool {
    grant.abs_diff(share) * SETTLED <= grant
}

/// Divides `limit` requests per window among streams asking `demands`, both in thousandths of a
/// request per window, in stream order. The shares add up to `limit` exactly when a stream asks
/// for something, and to the least shares when none does; when there is one request per window
/// for every stream, every stream gets one at least (the least share), so that none is shut out
/// before its demand is known. Deterministic: every replica divides the same demands the same way.
pub fn divide(limit: u64, demands: &[u64]) -> Vec<u64> {
    let n = demands.len() as u64;
    if n == 0 {
        return Vec::new();
    }
    let floor = if limit >= n * MILLI { MILLI } else { 0 };
    let wants: Vec<u64> = demands.iter().map(|&d| d.max(floor)).collect();
    // Water-filling: the smallest demands are met first, each at most an equal part of what is
    // left.
    let mut order: Vec<usize> = (0..wants.len()).collect();
    order.sort_by_key(|&i| (wants[i], i));
    let mut left = limit;
    let mut given = vec![0u64; wants.len()];
    for (k, &i) in order.iter().enumerate() {
        let level = left / (n - k as u64);
        given[i] = wants[i].min(level);
        left -= given[i];
    }
    // What nobody asked for, in equal parts among the streams that ask for some; the indivisible
    // rest, a thousandth each to the first of them.
    let asking = demands.iter().filter(|&&d| d > 0).count() as u64;
    if asking == 0 {
        return given;
    }
    let (each, rest) = (left / asking, left % asking);
    let asked = given.iter_mut().zip(demands).filter(|(_, d)| **d > 0);
    for (k, (g, _)) in asked.enumerate() {
        *g += each + u64::from((k as u64) < rest);
    }
    given
}

#[cfg(test)]
mod tests {
    use super::*;

    fn requests(shares: &[u64]) -> Vec<u64> {
        shares.iter().map(|d| d * MILLI).collect()
    }

    #[test]
    fn streams_that_all_ask_too_much_get_equal_parts() {
        assert_eq!(
            divide(20 * MILLI, &requests(&[30, 30])),
            requests(&[10, 10])
        );
        assert_eq!(
            divide(20 * MILLI, &requests(&[30, 30, 30])),
            [6666, 6667, 6667],
            "thirds, to the thousandth"
        );
    }

    #[test]
    fn a_small_demand_is_met_and_the_rest_goes_to_the_others() {
        assert_eq!(
            divide(20 * MILLI, &requests(&[2, 30, 30])),
            requests(&[2, 9, 9])
        );
        assert_eq!(
            divide(100 * MILLI, &requests(&[10, 20, 200])),
            requests(&[10, 20, 70])
        );
    }

    #[test]
    fn an_idle_stream_keeps_one_request_and_the_busy_one_gets_the_rest() {
        assert_eq!(divide(20 * MILLI, &requests(&[0, 30])), requests(&[1, 19]));
    }

    #[test]
    fn a_grant_within_2_percent_of_its_share_stays() {
        assert!(settled(10_000, 10_200));
        assert!(settled(10_000, 9_800));
        assert!(!settled(10_000, 10_201));
        assert!(!settled(10_000, 9_799));
        assert!(!settled(0, 1));
        assert!(settled(0, 0));
    }

    #[test]
    fn what_nobody_asks_for_is_spread_evenly() {
        assert_eq!(divide(20 * MILLI, &requests(&[2, 4])), requests(&[9, 11]));
        assert_eq!(
            divide(20 * MILLI, &requests(&[0, 2, 4])),
            [1000, 8500, 10500],
            "not to the idle stream"
        );
        assert_eq!(
            divide(20 * MILLI, &[0, 2000, 4001]),
            [1000, 8500, 10500],
            "the indivisible rest to the first that asks"
        );
    }

    #[test]
    fn idle_streams_alone_keep_the_least_share_and_the_rest_is_free() {
        assert_eq!(
            divide(10 * MILLI, &requests(&[0, 0, 0])),
            requests(&[1, 1, 1])
        );
        assert_eq!(divide(2 * MILLI, &requests(&[0, 0, 0])), [0, 0, 0]);
    }

    #[test]
    fn less_than_a_request_per_stream_is_still_divided() {
        assert_eq!(divide(2 * MILLI, &requests(&[5, 5, 5])), [666, 667, 667]);
    }

    #[test]
    fn shares_add_up_to_the_limit_when_a_stream_asks_and_an_idle_one_gets_the_least() {
        let mut seed = 7u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..2000 {
            let limit = next() % 10_000 * MILLI;
            let n = (next() % 12 + 1) as usize;
            // A quarter of the streams idle.
            let demands: Vec<u64> = (0..n)
                .map(|_| next() % (limit + 2) * u64::from(next() % 4 != 0))
                .collect();
            let shares = divide(limit, &demands);
            let sum = shares.iter().sum::<u64>();
            if demands.iter().any(|&d| d > 0) {
                assert_eq!(sum, limit, "{limit} {demands:?}");
            } else {
                assert!(sum <= limit, "{limit} {demands:?}");
            }
            if limit >= n as u64 * MILLI {
                assert!(
                    shares.iter().all(|&s| s >= MILLI),
                    "{limit} {demands:?} {shares:?}"
                );
            }
            let least = if limit >= n as u64 * MILLI { MILLI } else { 0 };
            for (i, &s) in shares.iter().enumerate() {
                if demands[i] == 0 {
                    assert_eq!(s, least, "{limit} {demands:?} {shares:?}");
                }
            }
            // Max-min: a stream below its demand has at least as much as any other stream
            // (give or take the thousandth of the rest).
            for (i, &s) in shares.iter().enumerate() {
                if s < demands[i] {
                    assert!(
                        shares.iter().all(|&o| o <= s + 1),
                        "{limit} {demands:?} {shares:?}"
                    );
                }
            }
        }
    }
}
