//! What an interface does to frames before skb (generic) mode's program
//! sees them, through ioctls (of the calling thread's network namespace):
//! the receive offloads that merge frames (GRO, LRO), read and turned off,
//! and the MTU, past which a buffer is many frames' worth
//! (`limiter_common::segments`). In skb mode the program runs on socket
//! buffers after GRO: one merged buffer of 40 frames would be one packet
//! to a packet limit. Native mode sees every frame before any of it.

use std::{io, os::fd::AsRawFd};

const SIOCETHTOOL: libc::c_ulong = 0x8946;
const SIOCGIFMTU: libc::c_ulong = 0x8921;
const ETHTOOL_GFLAGS: u32 = 0x25;
const ETHTOOL_SFLAGS: u32 = 0x26;
const ETHTOOL_GGRO: u32 = 0x2b;
const ETHTOOL_SGRO: u32 = 0x2c;
/// `ETH_FLAG_LRO` of `ETHTOOL_GFLAGS`.
const FLAG_LRO: u32 = 1 << 15;

/// `struct ethtool_value`.
#[repr(C)]
struct Value {
    cmd: u32,
    data: u32,
}

/// `struct ifreq` with `ifr_data`.
#[repr(C)]
struct IfReq {
    name: [libc::c_char; libc::IFNAMSIZ],
    data: *mut Value,
    _pad: [u8; 16],
}

/// Runs `request` on an `ifreq` naming `iface`, whose union `fill` sets
/// and whose union the result is read from.
fn ifreq<T>(
    iface: &str,
    request: libc::c_ulong,
    fill: impl FnOnce(&mut IfReq) -> T,
) -> io::Result<IfReq> {
    if iface.len() >= libc::IFNAMSIZ {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "interface name too long",
        ));
    }
    // SAFETY: plain socket(2), any socket serves for the ioctl.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor this function owns.
    let socket = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let mut req = IfReq {
        name: [0; libc::IFNAMSIZ],
        data: std::ptr::null_mut(),
        _pad: [0; 16],
    };
    for (to, from) in req.name.iter_mut().zip(iface.bytes()) {
        *to = from as libc::c_char;
    }
    fill(&mut req);
    // SAFETY: an ifreq naming the interface, its union filled as the
    // request takes it (a pointer to a live value, or nothing to read).
    if unsafe { libc::ioctl(socket.as_raw_fd(), request, &raw mut req) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(req)
}

fn ethtool(iface: &str, cmd: u32, data: u32) -> io::Result<u32> {
    let mut value = Value { cmd, data };
    ifreq(iface, SIOCETHTOOL, |req| req.data = &raw mut value)?;
    Ok(value.data)
}

/// The MTU of `iface`.
pub fn mtu(iface: &str) -> io::Result<u32> {
    let req = ifreq(iface, SIOCGIFMTU, |_| ())?;
    // `ifr_mtu`, an int at the start of the union.
    Ok((req.data as usize as u64 & 0xffff_ffff) as u32)
}

/// Which merging offloads are on for `iface`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Merging {
    pub gro: bool,
    pub lro: bool,
}

impl Merging {
    pub fn any(self) -> bool {
        self.gro || self.lro
    }

    /// Their names, as `ethtool -K` spells them.
    pub fn names(self) -> Vec<&'static str> {
        [(self.gro, "gro"), (self.lro, "lro")]
            .into_iter()
            .filter_map(|(on, name)| on.then_some(name))
            .collect()
    }
}

/// The merging offloads on for `iface` (an interface without ethtool
/// support has none).
pub fn merging(iface: &str) -> io::Result<Merging> {
    let unsupported = |e: &io::Error| e.raw_os_error() == Some(libc::EOPNOTSUPP);
    let gro = match ethtool(iface, ETHTOOL_GGRO, 0) {
        Ok(on) => on != 0,
        Err(e) if unsupported(&e) => false,
        Err(e) => return Err(e),
    };
    let lro = match ethtool(iface, ETHTOOL_GFLAGS, 0) {
        Ok(flags) => flags & FLAG_LRO != 0,
        Err(e) if unsupported(&e) => false,
        Err(e) => return Err(e),
    };
    Ok(Merging { gro, lro })
}

/// Turns GRO on or off on `iface` (what `ethtool -K IF gro on|off` does).
pub fn set_gro(iface: &str, on: bool) -> io::Result<()> {
    ethtool(iface, ETHTOOL_SGRO, u32::from(on)).map(drop)
}

/// Turns GRO and LRO off on `iface`; what was on before.
pub fn stop_merging(iface: &str) -> io::Result<Merging> {
    let before = merging(iface)?;
    if before.gro {
        set_gro(iface, false)?;
    }
    if before.lro {
        let flags = ethtool(iface, ETHTOOL_GFLAGS, 0)?;
        ethtool(iface, ETHTOOL_SFLAGS, flags & !FLAG_LRO)?;
    }
    let after = merging(iface)?;
    if after.any() {
        return Err(io::Error::other(format!(
            "{} still on after turning it off",
            after.names().join(" and ")
        )));
    }
    Ok(before)
}

#[cfg(test)]
mod tests {
    /// Loopback's MTU is 65,536 on every kernel the limiter runs on.
    #[test]
    fn the_mtu_is_read() {
        assert_eq!(super::mtu("lo").unwrap(), 65_536);
        assert!(super::mtu("no-such-if0").is_err());
    }
}
