//! A TCP proxy on loopback standing for one fixed address in front of Redis (a Kubernetes
//! Service, a cloud provider's primary endpoint, a DNS name): each new connection goes to the
//! target of the moment, while connections already open stay on the server they reached, as
//! they do when such an address is moved to another node. It can also be cut, as a network
//! partition cuts: connections stay open and nothing is forwarded until it is mended; or
//! severed: every connection is closed, and new ones wait until it is mended.

use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

/// A running proxy; it and every connection it forwards stop when it is dropped.
pub struct Proxy {
    pub port: u16,
    target: Arc<AtomicU16>,
    open: watch::Sender<bool>,
    severed: watch::Sender<u64>,
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
        let (open, forwarding) = watch::channel(true);
        let (severed, severing) = watch::channel(0);
        let to = target.clone();
        let accept = tokio::spawn(async move {
            // Owned here, so that aborting this task ends every connection with it.
            let mut connections = JoinSet::new();
            loop {
                let Ok((inbound, _)) = listener.accept().await else {
                    continue;
                };
                let forwarding = forwarding.clone();
                let mut severing = severing.clone();
                severing.mark_unchanged();
                let to = to.clone();
                connections.spawn(async move {
                    if !mended(&forwarding).await {
                        return;
                    }
                    let port = to.load(Ordering::SeqCst);
                    if let Ok(outbound) = TcpStream::connect(("127.0.0.1", port)).await {
                        let (from_client, to_client) = inbound.into_split();
                        let (from_server, to_server) = outbound.into_split();
                        let pumps = async {
                            tokio::join!(
                                pump(from_client, to_server, forwarding.clone()),
                                pump(from_server, to_client, forwarding),
                            )
                        };
                        tokio::select! {
                            _ = pumps => {}
                            _ = severing.changed() => {}
                        }
                    }
                });
                while connections.try_join_next().is_some() {}
            }
        });
        Proxy {
            port,
            target,
            open,
            severed,
            accept,
        }
    }

    /// Sends new connections to `127.0.0.1:target`; open ones stay where they are.
    pub fn switch(&self, target: u16) {
        self.target.store(target, Ordering::SeqCst);
    }

    /// Stops forwarding, in both directions, holding every connection open (new ones too).
    pub fn cut(&self) {
        self.open.send_replace(false);
    }

    /// Closes every connection, and holds new ones until it is mended.
    pub fn sever(&self) {
        self.cut();
        self.severed.send_modify(|n| *n += 1);
    }

    /// Forwards again what was held, and what comes next.
    pub fn mend(&self) {
        self.open.send_replace(true);
    }
}

/// Waits until the proxy forwards; false once it is gone.
async fn mended(forwarding: &watch::Receiver<bool>) -> bool {
    forwarding.clone().wait_for(|open| *open).await.is_ok()
}

/// Copies `from` to `to` while the proxy forwards, holding what it read while it is cut.
async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, forwarding: watch::Receiver<bool>) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if !mended(&forwarding).await || to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}
