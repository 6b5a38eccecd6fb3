//! The reference parser, written from the header layouts: what a frame
//! is (non-IP, malformed, or a packet with its source, protocol, port
//! and fragment flags).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

const MAX_OFFSET: usize = 16 * 1024;
const MAX_IPV6_EXT_HEADERS: usize = 6;
pub(super) const UNKNOWN_PROTOCOL: u8 = 255;

/// What the reference makes of a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Parsed {
    NonIp,
    Malformed,
    Ip(Packet),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Port {
    /// TCP, UDP and SCTP.
    Known(u16),
    /// Other protocols have none.
    None,
    /// A later fragment, or a transport header that cannot be read.
    Unknown,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Packet {
    pub(super) source: IpAddr,
    pub(super) protocol: u8,
    pub(super) port: Port,
    pub(super) fragment: bool,
    pub(super) later_fragment: bool,
    pub(super) first_fragment: bool,
    pub(super) unreadable: bool,
    pub(super) tiny: bool,
    /// What identifies the datagram of a fragment, besides its source.
    pub(super) datagram: u64,
}

/// `n` bytes at `at`, if the frame has them and they lie within the bytes
/// the program looks at.
fn bytes(frame: &[u8], at: usize, n: usize) -> Option<&[u8]> {
    (at <= MAX_OFFSET).then_some(())?;
    frame.get(at..at.checked_add(n)?)
}

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}

/// The destination port of the transport header at `at`: it must be whole
/// within the frame and within the datagram (which ends at `end`). `Err`:
/// it should be there and is not.
fn transport(frame: &[u8], at: usize, end: usize, protocol: u8) -> Result<Port, ()> {
    let len = match protocol {
        6 => 20,
        17 => 8,
        132 => 12,
        // ICMP's type, code and checksum: present, or the packet is cut.
        1 | 58 => {
            return if at + 4 <= end && bytes(frame, at, 4).is_some() {
                Ok(Port::None)
            } else {
                Err(())
            };
        }
        _ => return Ok(Port::None),
    };
    if at + len > end {
        return Err(());
    }
    let header = bytes(frame, at, len).ok_or(())?;
    Ok(Port::Known(be16(&header[2..4])))
}

pub(super) fn reference_parse(frame: &[u8]) -> Parsed {
    let Some(eth) = bytes(frame, 0, 14) else {
        return Parsed::Malformed;
    };
    let mut ether_type = be16(&eth[12..14]);
    let mut at = 14;
    let is_tag = |t: u16| t == 0x8100 || t == 0x88a8;
    for _ in 0..2 {
        if !is_tag(ether_type) {
            break;
        }
        let Some(tag) = bytes(frame, at, 4) else {
            return Parsed::Malformed;
        };
        ether_type = be16(&tag[2..4]);
        at += 4;
    }
    match ether_type {
        0x0800 => ipv4(frame, at),
        0x86dd => ipv6(frame, at),
        t if is_tag(t) => Parsed::Malformed,
        _ => Parsed::NonIp,
    }
}

fn ipv4(frame: &[u8], at: usize) -> Parsed {
    let Some(h) = bytes(frame, at, 20) else {
        return Parsed::Malformed;
    };
    let (version, ihl) = (h[0] >> 4, usize::from(h[0] & 0x0f));
    if version != 4 || ihl < 5 {
        return Parsed::Malformed;
    }
    let end = at + usize::from(be16(&h[2..4]));
    let flags_offset = be16(&h[6..8]);
    let (offset, more) = (flags_offset & 0x1fff, flags_offset & 0x2000 != 0);
    let protocol = h[9];
    let source = IpAddr::V4(Ipv4Addr::new(h[12], h[13], h[14], h[15]));
    let destination = u32::from_ne_bytes([h[16], h[17], h[18], h[19]]);
    let id = u16::from_ne_bytes([h[4], h[5]]);
    let mut packet = Packet {
        source,
        protocol,
        port: Port::Unknown,
        fragment: offset != 0 || more,
        later_fragment: offset != 0,
        first_fragment: offset == 0 && more,
        unreadable: false,
        tiny: false,
        datagram: u64::from(destination) << 32 | u64::from(id) << 8 | u64::from(protocol),
    };
    if offset == 0 {
        // One authentication header (RFC 4302) may come first; a second
        // one, or one cut short, leaves the transport unknown.
        let mut start = at + ihl * 4;
        let mut readable = true;
        if protocol == 51 {
            match bytes(frame, start, 2).filter(|_| start + 2 <= end) {
                Some(ah) => {
                    packet.protocol = ah[0];
                    start += (usize::from(ah[1]) + 2) * 4;
                    readable = ah[0] != 51;
                }
                None => readable = false,
            }
            if !readable {
                packet.protocol = UNKNOWN_PROTOCOL;
            }
        }
        match transport(frame, start, end, packet.protocol) {
            Ok(port) if readable => packet.port = port,
            _ => {
                packet.unreadable = true;
                packet.tiny = more;
            }
        }
    }
    Parsed::Ip(packet)
}

fn ipv6(frame: &[u8], at: usize) -> Parsed {
    let Some(h) = bytes(frame, at, 40) else {
        return Parsed::Malformed;
    };
    if h[0] >> 4 != 6 {
        return Parsed::Malformed;
    }
    let mut source = [0; 16];
    source.copy_from_slice(&h[8..24]);
    let source = IpAddr::V6(Ipv6Addr::from(source));
    let folded = (0..4).fold(0u32, |f, i| {
        f.rotate_left(7) ^ u32::from_ne_bytes(h[24 + 4 * i..28 + 4 * i].try_into().unwrap())
    });
    let end = match be16(&h[4..6]) {
        0 => usize::MAX,
        len => at + 40 + usize::from(len),
    };
    let mut next = h[6];
    let mut at = at + 40;
    let mut packet = Packet {
        source,
        protocol: UNKNOWN_PROTOCOL,
        port: Port::Unknown,
        fragment: false,
        later_fragment: false,
        first_fragment: false,
        unreadable: true,
        tiny: false,
        datagram: 0,
    };
    // Past what the parser walks, or cut short: the source is still known.
    let unreadable = |mut p: Packet, protocol: u8| {
        p.protocol = protocol;
        p.tiny = p.first_fragment;
        Parsed::Ip(p)
    };
    for _ in 0..=MAX_IPV6_EXT_HEADERS {
        match next {
            0 | 43 | 60 | 51 => {
                let Some(ext) = bytes(frame, at, 2) else {
                    return unreadable(packet, UNKNOWN_PROTOCOL);
                };
                // AH counts 4-byte units beyond 8 bytes; the others 8-byte units.
                at += if next == 51 {
                    (usize::from(ext[1]) + 2) * 4
                } else {
                    (usize::from(ext[1]) + 1) * 8
                };
                next = ext[0];
            }
            44 => {
                let Some(ext) = bytes(frame, at, 8) else {
                    return unreadable(packet, UNKNOWN_PROTOCOL);
                };
                packet.fragment = true;
                packet.datagram = u64::from(folded) << 32
                    | u64::from(u32::from_ne_bytes(ext[4..8].try_into().unwrap()));
                next = ext[0];
                at += 8;
                if be16(&ext[2..4]) >> 3 != 0 {
                    packet.later_fragment = true;
                    packet.unreadable = false;
                    return Parsed::Ip(packet);
                }
                packet.first_fragment = ext[3] & 1 != 0;
            }
            _ => {
                return match transport(frame, at, end, next) {
                    Ok(port) => Parsed::Ip(Packet {
                        protocol: next,
                        port,
                        unreadable: false,
                        ..packet
                    }),
                    Err(()) => unreadable(packet, next),
                };
            }
        }
    }
    unreadable(packet, UNKNOWN_PROTOCOL)
}
