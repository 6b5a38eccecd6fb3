//! Traffic in the lab's namespaces: floods and what the receiver
//! counted, listeners and connections across the veth pair, XDP
//! attachments, and the limiter started in-process on the receiver.

use std::{
    collections::HashMap,
    net::IpAddr,
    path::Path,
    process::Command,
    thread,
    time::{Duration, Instant},
};

use limiter::{
    lab::{self, FloodReport, FloodSource, Lab},
    rules::RuleSet,
    session::Session,
    wire::Mode,
};

/// The limiter in this process (`Session::start`) on the lab's receiving
/// interface in `mode`, started from inside the receiver's namespace, its
/// maps pinned at `pin_dir`.
pub fn session_on_receiver(lab: &Lab, set: &RuleSet, mode: Mode, pin_dir: &str) -> Session {
    lab.rx
        .enter(|| Session::start(set, &[lab::RX_IFACE.to_owned()], mode, Path::new(pin_dir)))
        .expect("entering the namespace")
        .expect("starting the limiter")
}

/// Sources flooding at `pps` each with UDP frames of `payload` bytes, over
/// veth pair `pair`.
pub fn sources(
    lab: &Lab,
    pair: u8,
    addrs: &[IpAddr],
    pps: u64,
    payload: usize,
) -> Vec<FloodSource> {
    lab.sources(pair, addrs, pps, payload)
}

/// Floods over every given veth pair at once for `duration`, lets the last
/// frames land, and returns what was sent on each pair and what the
/// receiver counted per source (over all pairs).
pub fn flood_pairs(
    lab: &Lab,
    per_pair: &[(u8, Vec<FloodSource>)],
    duration: Duration,
) -> (Vec<FloodReport>, HashMap<IpAddr, u64>) {
    let reports = thread::scope(|scope| {
        let floods: Vec<_> = per_pair
            .iter()
            .map(|(pair, sources)| {
                let socket = lab.sender(*pair).expect("opening the sender");
                scope.spawn(move || {
                    lab::flood(&socket, sources, duration, |_| {}).expect("flooding")
                })
            })
            .collect();
        floods
            .into_iter()
            .map(|f| f.join().expect("flood thread"))
            .collect()
    });
    thread::sleep(Duration::from_millis(300));
    (
        reports,
        lab.received().expect("reading the receiver's counters"),
    )
}

/// [`flood_pairs`] over the first pair only.
pub fn flood(
    lab: &Lab,
    sources: &[FloodSource],
    duration: Duration,
) -> (FloodReport, HashMap<IpAddr, u64>) {
    let (mut reports, received) = flood_pairs(lab, &[(0, sources.to_vec())], duration);
    (reports.remove(0), received)
}

/// Whether any XDP program is attached to `iface` in `netns`.
pub fn xdp_attached(netns: &str, iface: &str) -> bool {
    let out = Command::new("ip")
        .args(["-n", netns, "-j", "link", "show", iface])
        .output()
        .expect("running ip");
    assert!(out.status.success(), "ip link show {iface} failed");
    let links: serde_json::Value = serde_json::from_slice(&out.stdout).expect("ip -j output");
    links[0].get("xdp").is_some()
}

/// A TCP listener in the lab's receiving namespace that counts, itself,
/// the connections it accepts and the bytes it reads.
pub struct CountingListener {
    pub accepted: std::sync::Arc<std::sync::atomic::AtomicU64>,
    pub received: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl CountingListener {
    /// Listens on `addr` (the receiver's side of the lab). The lab's
    /// arrival counters drop what they count: they are removed, so the
    /// segments reach the stack.
    pub fn start(lab: &Lab, addr: std::net::SocketAddr) -> Self {
        use std::sync::{Arc, atomic::Ordering};
        lab.rx
            .exec("nft", &["delete", "table", "netdev", "limiter_lab"])
            .expect("nft");
        let listener = lab
            .rx
            .enter(|| std::net::TcpListener::bind(addr))
            .expect("netns")
            .expect("bind");
        let counting = Self {
            accepted: Default::default(),
            received: Default::default(),
        };
        let (accepted, received) = (
            Arc::clone(&counting.accepted),
            Arc::clone(&counting.received),
        );
        thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { break };
                accepted.fetch_add(1, Ordering::SeqCst);
                let received = Arc::clone(&received);
                thread::spawn(move || {
                    let mut buf = [0u8; 65536];
                    while let Ok(n) = std::io::Read::read(&mut stream, &mut buf) {
                        if n == 0 {
                            break;
                        }
                        received.fetch_add(n as u64, Ordering::SeqCst);
                    }
                });
            }
        });
        counting
    }

    /// Waits until it has read `bytes` in all (panics after 10 s).
    pub fn wait_received(&self, bytes: u64) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.received.load(std::sync::atomic::Ordering::SeqCst) < bytes {
            assert!(Instant::now() < deadline, "the data did not arrive");
            thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn accepted(&self) -> u64 {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// A TCP connection from the lab's sending namespace.
pub fn connect_from_sender(
    lab: &Lab,
    addr: std::net::SocketAddr,
    timeout: Duration,
) -> std::io::Result<std::net::TcpStream> {
    lab.tx
        .enter(|| std::net::TcpStream::connect_timeout(&addr, timeout))
        .expect("netns")
}
