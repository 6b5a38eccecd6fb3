//! How an XDP program is attached to an interface, as the kernel says
//! (rtnetlink's `IFLA_XDP`): native or skb (generic) mode. A link adopted
//! from pins, or attached by `auto`, is in whichever mode worked; `stats`
//! and the metrics say which, since skb mode is slower and sees packets
//! after GRO.

use std::{io, mem::size_of, os::fd::AsRawFd};

use crate::wire::Mode;

const RTM_GETLINK: u16 = 18;
const RTM_NEWLINK: u16 = 16;
const NLMSG_ERROR: u16 = 2;
const NLM_F_REQUEST: u16 = 1;
const IFLA_XDP: u16 = 43;
const IFLA_XDP_ATTACHED: u16 = 2;
/// `XDP_ATTACHED_*`.
const ATTACHED_DRV: u8 = 1;
const ATTACHED_SKB: u8 = 2;
const ATTACHED_HW: u8 = 3;
const ATTACHED_MULTI: u8 = 4;

/// `struct nlmsghdr` and `struct ifinfomsg`, as one request.
#[repr(C)]
struct Request {
    len: u32,
    kind: u16,
    flags: u16,
    seq: u32,
    pid: u32,
    family: u8,
    _pad: u8,
    link_type: u16,
    index: i32,
    link_flags: u32,
    change: u32,
}

/// The mode XDP is attached to interface `ifindex` in (of the calling
/// thread's network namespace); `None` when no program is attached.
pub fn xdp_mode(ifindex: u32) -> io::Result<Option<Mode>> {
    // SAFETY: plain socket(2).
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor this function owns.
    let socket = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let request = Request {
        len: size_of::<Request>() as u32,
        kind: RTM_GETLINK,
        flags: NLM_F_REQUEST,
        seq: 1,
        pid: 0,
        family: libc::AF_UNSPEC as u8,
        _pad: 0,
        link_type: 0,
        index: ifindex as i32,
        link_flags: 0,
        change: 0,
    };
    // SAFETY: `request` is a plain `repr(C)` value of the length given;
    // the kernel is the destination (a zeroed sockaddr_nl).
    let sent = unsafe {
        let mut kernel: libc::sockaddr_nl = std::mem::zeroed();
        kernel.nl_family = libc::AF_NETLINK as u16;
        libc::sendto(
            socket.as_raw_fd(),
            (&raw const request).cast(),
            size_of::<Request>(),
            0,
            (&raw const kernel).cast(),
            size_of::<libc::sockaddr_nl>() as u32,
        )
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut buffer = vec![0u8; 64 * 1024];
    // SAFETY: a writable buffer of the length given.
    let n = unsafe {
        libc::recv(
            socket.as_raw_fd(),
            buffer.as_mut_ptr().cast(),
            buffer.len(),
            0,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    parse_reply(&buffer[..n as usize])
}

/// The XDP mode in an `RTM_NEWLINK` reply.
fn parse_reply(reply: &[u8]) -> io::Result<Option<Mode>> {
    let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, format!("rtnetlink: {what}"));
    let u16_at = |at: usize| {
        reply
            .get(at..at + 2)
            .map(|b| u16::from_ne_bytes([b[0], b[1]]))
    };
    let kind = u16_at(4).ok_or_else(|| bad("reply cut short"))?;
    if kind == NLMSG_ERROR {
        let errno = reply
            .get(16..20)
            .map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
            .ok_or_else(|| bad("error cut short"))?;
        return Err(io::Error::from_raw_os_error(-errno));
    }
    if kind != RTM_NEWLINK {
        return Err(bad("not a link"));
    }
    // nlmsghdr (16) and ifinfomsg (16), then attributes, 4-aligned.
    let mut at = 32;
    while let (Some(len), Some(kind)) = (u16_at(at), u16_at(at + 2)) {
        let len = usize::from(len);
        if len < 4 || at + len > reply.len() {
            return Err(bad("attribute cut short"));
        }
        if kind & 0x3fff == IFLA_XDP {
            let mut inner = at + 4;
            while let (Some(ilen), Some(ikind)) = (u16_at(inner), u16_at(inner + 2)) {
                let ilen = usize::from(ilen);
                if ilen < 4 || inner + ilen > at + len {
                    return Err(bad("XDP attribute cut short"));
                }
                if ikind == IFLA_XDP_ATTACHED {
                    let attached = *reply.get(inner + 4).ok_or_else(|| bad("no mode"))?;
                    return Ok(match attached {
                        ATTACHED_DRV | ATTACHED_HW | ATTACHED_MULTI => Some(Mode::Native),
                        ATTACHED_SKB => Some(Mode::Skb),
                        _ => None,
                    });
                }
                inner += (ilen + 3) & !3;
            }
            return Ok(None);
        }
        at += (len + 3) & !3;
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An `RTM_NEWLINK` reply with one `IFLA_XDP` attribute holding `mode`.
    fn reply(mode: u8) -> Vec<u8> {
        let mut r = vec![0u8; 32];
        r[4..6].copy_from_slice(&RTM_NEWLINK.to_ne_bytes());
        // IFLA_IFNAME "x", then IFLA_XDP { IFLA_XDP_ATTACHED mode }.
        r.extend_from_slice(&6u16.to_ne_bytes());
        r.extend_from_slice(&3u16.to_ne_bytes());
        r.extend_from_slice(b"x\0\0\0");
        r.extend_from_slice(&12u16.to_ne_bytes());
        r.extend_from_slice(&(IFLA_XDP | 0x8000).to_ne_bytes());
        r.extend_from_slice(&5u16.to_ne_bytes());
        r.extend_from_slice(&IFLA_XDP_ATTACHED.to_ne_bytes());
        r.extend_from_slice(&[mode, 0, 0, 0]);
        let len = r.len() as u32;
        r[0..4].copy_from_slice(&len.to_ne_bytes());
        r
    }

    #[test]
    fn the_attached_mode_is_read_from_the_reply() {
        assert_eq!(parse_reply(&reply(ATTACHED_SKB)).unwrap(), Some(Mode::Skb));
        assert_eq!(
            parse_reply(&reply(ATTACHED_DRV)).unwrap(),
            Some(Mode::Native)
        );
        assert_eq!(parse_reply(&reply(0)).unwrap(), None);
        assert!(parse_reply(&reply(ATTACHED_SKB)[..44]).is_err());
    }
}
