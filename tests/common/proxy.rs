//! A TCP proxy on loopback standing for one fixed address in front of Redis (a Kubernetes
//! Service, a cloud provider's primary endpoint, a DNS name): each new connection goes to the
//! target of the moment, while connections already open stay on the server they reached, as
//! they do when such an address is moved to another node.

use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};

use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};

/// A running proxy; it and every connection it forwards stop when it is dropped.
pub struct Proxy {
    pub port: u16,
    target: Arc<AtomicU16>,
    accept: JoinHandle<()>,
}

impl Proxy {
    /// Listens on a free loopback port, forwarding to `127.0.0.1:target`.
    pub async fn start(target: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("the proxy listens on loopback");
        let port = listener.local_addr().expect("a bound address").port();
        let target = Arc::new(AtomicU16::new(target));
        let to = target.clone();
        let accept = tokio::spawn(async move {
            // Owned here, so that aborting this task ends every connection with it.
            let mut connections = JoinSet::new();
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    continue;
                };
                let port = to.load(Ordering::SeqCst);
                connections.spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(("127.0.0.1", port)).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                while connections.try_join_next().is_some() {}
            }
        });
        Proxy {
            port,
            target,
            accept,
        }
    }

    /// Sends new connections to `127.0.0.1:target`; open ones stay where they are.
    pub fn switch(&self, target: u16) {
        self.target.store(target, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}
