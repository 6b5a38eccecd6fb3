//! Test traffic: crafted frames sent on a raw packet socket at a paced rate,
//! per source, with an exact count of what left.

use std::{
    io,
    net::IpAddr,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use etherparse::PacketBuilder;

/// Where crafted frames go: the receiver's MAC and addresses.
#[derive(Clone, Copy, Debug)]
pub struct Target {
    pub src_mac: [u8; 6],
    pub dst_mac: [u8; 6],
    pub v4: std::net::Ipv4Addr,
    pub v6: std::net::Ipv6Addr,
}

/// A UDP datagram from `source` to the target's discard port, as an
/// Ethernet frame of `payload` bytes of data.
pub fn udp_frame(target: &Target, source: IpAddr, payload: usize) -> Vec<u8> {
    let eth = PacketBuilder::ethernet2(target.src_mac, target.dst_mac);
    let data = vec![0x5a; payload];
    let mut frame = Vec::with_capacity(payload + 70);
    let result = match source {
        IpAddr::V4(src) => eth
            .ipv4(src.octets(), target.v4.octets(), 64)
            .udp(40000, 9)
            .write(&mut frame, &data),
        IpAddr::V6(src) => eth
            .ipv6(src.octets(), target.v6.octets(), 64)
            .udp(40000, 9)
            .write(&mut frame, &data),
    };
    result.expect("writing to a Vec cannot fail");
    frame
}

/// A raw packet socket bound to one interface, for sending whole frames.
pub struct FrameSocket {
    fd: OwnedFd,
}

impl FrameSocket {
    /// Opens a socket on `ifindex` of the calling thread's namespace.
    pub fn open(ifindex: u32) -> Result<Self> {
        // SAFETY: plain socket(2); protocol 0 means send-only.
        let raw = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        if raw < 0 {
            return Err(io::Error::last_os_error()).context("opening a packet socket");
        }
        // SAFETY: raw is a fresh, owned fd.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_ifindex = ifindex as i32;
        // SAFETY: addr is a valid sockaddr_ll of the given size.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&raw const addr).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error()).context("binding the packet socket");
        }
        Ok(Self { fd })
    }

    /// Sends one frame; `false` when the device queue was full and it was
    /// not sent (the caller may retry).
    pub fn send(&self, frame: &[u8]) -> Result<bool> {
        // SAFETY: valid fd and buffer.
        let n = unsafe { libc::send(self.fd.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) };
        if n >= 0 {
            return Ok(true);
        }
        let error = io::Error::last_os_error();
        match error.raw_os_error() {
            Some(libc::ENOBUFS | libc::EAGAIN) => Ok(false),
            _ => Err(error).context("sending a frame"),
        }
    }
}

/// One flooding source: its frame and its rate.
#[derive(Clone, Debug)]
pub struct FloodSource {
    pub addr: IpAddr,
    pub frame: Vec<u8>,
    pub pps: u64,
}

/// What a flood sent, per source, and over how long.
#[derive(Clone, Debug, Default)]
pub struct FloodReport {
    pub sent: Vec<u64>,
    /// From the first frame sent to the last.
    pub elapsed: Duration,
}

/// Sends every source at its rate for `duration`, interleaved, paced in
/// ~200 µs steps; the first frame of each source leaves at time zero.
/// `progress` is called after every step with the counts so far, so a
/// reader comparing them with what arrived is never more than a step behind.
pub fn flood(
    socket: &FrameSocket,
    sources: &[FloodSource],
    duration: Duration,
    mut progress: impl FnMut(&[u64]),
) -> Result<FloodReport> {
    let mut sent = vec![0u64; sources.len()];
    let start = Instant::now();
    let mut last = start;
    loop {
        let now = Instant::now();
        let t = now.duration_since(start).min(duration);
        for (source, sent) in sources.iter().zip(sent.iter_mut()) {
            let due = (source.pps as u128 * t.as_nanos() / 1_000_000_000) as u64 + 1;
            while *sent < due {
                if !socket.send(&source.frame)? {
                    break;
                }
                *sent += 1;
                last = Instant::now();
            }
        }
        progress(&sent);
        if t >= duration {
            break;
        }
        thread::sleep(Duration::from_micros(200));
    }
    Ok(FloodReport {
        sent,
        elapsed: last.duration_since(start),
    })
}
