//! Header parsing: a cursor moves through the frame, one bounds-checked step
//! per header. Every read is checked against `data_end` before it happens,
//! which is also what the verifier demands. Multi-byte fields are read as
//! byte arrays in network byte order.

use aya_ebpf::programs::XdpContext;
use core::mem;
use limiter_common::abi::{MAX_IPV6_EXT_HEADERS, NO_PORT, UNKNOWN_PROTOCOL};
use network_types::{
    eth::{EthHdr, EtherType},
    ip::{Ipv4Hdr, Ipv6Hdr},
    vlan::VlanHdr,
};

/// Protocol numbers the parser looks inside.
mod proto {
    pub const HOP_BY_HOP: u8 = 0;
    pub const ICMP: u8 = 1;
    pub const TCP: u8 = 6;
    pub const UDP: u8 = 17;
    pub const ROUTING: u8 = 43;
    pub const FRAGMENT: u8 = 44;
    pub const AUTH: u8 = 51;
    pub const ICMPV6: u8 = 58;
    pub const DEST_OPTS: u8 = 60;
    pub const SCTP: u8 = 132;
}

/// Far enough for two VLAN tags, IPv4 options or a full IPv6 extension
/// chain; bounding the cursor keeps the verifier's offset ranges finite.
const MAX_OFFSET: usize = 16 * 1024;

/// The frame's source cannot be known: its link or network header is
/// truncated, malformed, or deeper than we walk. (Past the network header
/// nothing is malformed: the source is known, and its limits apply.)
pub struct Malformed;

/// Source address of an IP packet.
pub enum Source {
    V4([u8; 4]),
    V6([u8; 16]),
}

/// What the limiter needs from an IP packet.
pub struct Packet {
    pub source: Source,
    /// IP protocol number of the transport header; [`UNKNOWN_PROTOCOL`]
    /// when it is behind more IPv6 extension headers than we walk.
    pub protocol: u8,
    /// Destination port for TCP, UDP and SCTP; [`NO_PORT`] for other
    /// protocols, for later fragments, which carry no transport header, and
    /// when the transport header cannot be read.
    pub dest_port: u32,
    /// The TCP flags byte of a TCP segment whose header was read; 0 for
    /// anything else.
    pub tcp_flags: u8,
    pub fragment: bool,
    /// The transport header should be there but cannot be read: cut short,
    /// or behind more IPv6 extension headers than the parser walks.
    pub unreadable: bool,
    /// The packet has a port that it does not show: a later fragment, or
    /// an unreadable transport header. It is charged as if it could have
    /// any port (never "no limit").
    pub port_unknown: bool,
    /// A first fragment too short for its transport header (RFC 1858's
    /// tiny fragment, a way around port filters): dropped.
    pub tiny_fragment: bool,
    /// Offset 0 with more to come: the fragment whose verdict the later
    /// ones of its datagram follow.
    pub first_fragment: bool,
    /// For fragments: the datagram, as `abi::FragmentKey::datagram`.
    pub datagram: u64,
}

impl Packet {
    /// A fragment past the first: no transport header of its own.
    pub fn later_fragment(&self) -> bool {
        self.fragment && self.port_unknown && !self.unreadable
    }
}

/// Reads a `T` at `offset` into the frame, if the frame is long enough.
#[inline(always)]
fn ptr_at<T>(ctx: &XdpContext, offset: usize) -> Result<*const T, Malformed> {
    let start = ctx.data();
    let end = ctx.data_end();
    if offset > MAX_OFFSET || start + offset + mem::size_of::<T>() > end {
        return Err(Malformed);
    }
    Ok((start + offset) as *const T)
}

/// Parses a frame: `Ok(None)` for non-IP frames, which pass untouched.
#[inline(always)]
pub fn parse(ctx: &XdpContext) -> Result<Option<Packet>, Malformed> {
    let eth: *const EthHdr = ptr_at(ctx, 0)?;
    // SAFETY: `ptr_at` checked this packet read (the Ethernet header) against
    // `data_end`, as the verifier requires; `ether_type` is a u16 at an even
    // offset, copied out.
    let mut ether_type = unsafe { (*eth).ether_type };
    let mut offset = EthHdr::LEN;
    // Up to two tags: 802.1Q, or an 802.1ad outer tag over an 802.1Q one.
    for _ in 0..2 {
        if ether_type != EtherType::Ieee8021q as u16 && ether_type != EtherType::Ieee8021ad as u16 {
            break;
        }
        let vlan: *const VlanHdr = ptr_at(ctx, offset)?;
        // SAFETY: `ptr_at` checked the tag's bounds against `data_end` just above;
        // its `ether_type` is a u16 at an even offset, copied out.
        ether_type = unsafe { (*vlan).ether_type };
        offset += VlanHdr::LEN;
    }
    if ether_type == EtherType::Ipv4 as u16 {
        parse_ipv4(ctx, offset).map(Some)
    } else if ether_type == EtherType::Ipv6 as u16 {
        parse_ipv6(ctx, offset).map(Some)
    } else if ether_type == EtherType::Ieee8021q as u16
        || ether_type == EtherType::Ieee8021ad as u16
    {
        // A third tag: deeper than we look, so we cannot tell what it carries.
        Err(Malformed)
    } else {
        Ok(None)
    }
}

#[inline(always)]
fn parse_ipv4(ctx: &XdpContext, offset: usize) -> Result<Packet, Malformed> {
    let ip: *const Ipv4Hdr = ptr_at(ctx, offset)?;
    // SAFETY: `ptr_at` checked the whole IPv4 header against `data_end`; its
    // fields are bytes and byte arrays (alignment 1), copied out.
    let (vihl, total_len, frags, protocol, source) = unsafe {
        (
            (*ip).vihl,
            (*ip).tot_len,
            (*ip).frags,
            (*ip).proto,
            (*ip).src_addr,
        )
    };
    // SAFETY: the same bounds-checked header, byte arrays copied out.
    let (destination, id) = unsafe { ((*ip).dst_addr, (*ip).id) };
    // Where the datagram ends: bytes past it (Ethernet padding, or bytes
    // appended to dress up a tiny fragment) are not its transport header.
    let ip_end = offset + usize::from(u16::from_be_bytes(total_len));
    let ihl = (vihl & 0x0f) as usize;
    if vihl >> 4 != 4 || ihl < 5 {
        return Err(Malformed);
    }
    // Fragment offset in 8-byte units, below the three flag bits.
    let fragment_offset = u16::from_be_bytes(frags) & 0x1fff;
    let more_fragments = frags[0] & 0x20 != 0;
    let mut packet = Packet {
        source: Source::V4(source),
        protocol,
        dest_port: NO_PORT,
        tcp_flags: 0,
        fragment: fragment_offset != 0 || more_fragments,
        unreadable: false,
        port_unknown: fragment_offset != 0,
        tiny_fragment: false,
        first_fragment: fragment_offset == 0 && more_fragments,
        // What IPv4 reassembles by, besides the source: all of it, exactly.
        datagram: u64::from(u32::from_ne_bytes(destination)) << 32
            | u64::from(u16::from_ne_bytes(id)) << 8
            | u64::from(protocol),
    };
    if fragment_offset == 0 {
        // AH (RFC 4302) authenticates what follows, it does not hide it:
        // the transport header and its port come after it. Its length is
        // in 4-byte units, less 2. One AH: a second one is unreadable.
        let mut transport = offset + ihl * 4;
        let mut readable = true;
        if protocol == proto::AUTH {
            // Within the datagram: padding past it is not its AH.
            let ah = if transport + 2 > ip_end {
                Err(Malformed)
            } else {
                ptr_at::<[u8; 2]>(ctx, transport)
            };
            match ah {
                Ok(ah) => {
                    // SAFETY: `ptr_at` checked these two bytes against `data_end`; a
                    // byte array, copied out.
                    let [next, len] = unsafe { *ah };
                    packet.protocol = next;
                    transport += (len as usize + 2) * 4;
                    readable = next != proto::AUTH;
                }
                Err(Malformed) => readable = false,
            }
            if !readable {
                packet.protocol = UNKNOWN_PROTOCOL;
            }
        }
        match parse_transport(ctx, transport, ip_end, packet.protocol) {
            Ok((port, tcp_flags)) if readable => {
                packet.dest_port = port;
                packet.tcp_flags = tcp_flags;
            }
            _ => {
                packet.unreadable = true;
                packet.port_unknown = true;
                packet.tiny_fragment = more_fragments;
            }
        }
    }
    Ok(packet)
}

#[inline(always)]
fn parse_ipv6(ctx: &XdpContext, offset: usize) -> Result<Packet, Malformed> {
    let ip: *const Ipv6Hdr = ptr_at(ctx, offset)?;
    // SAFETY: `ptr_at` checked the whole IPv6 header against `data_end`; its
    // fields are bytes and byte arrays (alignment 1), copied out.
    let (vcf, payload_len, mut next, source, destination) = unsafe {
        (
            (*ip).vcf,
            (*ip).payload_len,
            (*ip).next_hdr,
            (*ip).src_addr,
            (*ip).dst_addr,
        )
    };
    // The destination folded to 32 bits, beside the identification.
    let folded = (0..4).fold(0u32, |h, i| {
        h.rotate_left(7)
            ^ u32::from_ne_bytes([
                destination[4 * i],
                destination[4 * i + 1],
                destination[4 * i + 2],
                destination[4 * i + 3],
            ])
    });
    let mut datagram = 0u64;
    if vcf[0] >> 4 != 6 {
        return Err(Malformed);
    }
    // Where the packet ends (a jumbogram's payload length is 0: the frame's end).
    let ip_end = match u16::from_be_bytes(payload_len) {
        0 => usize::MAX,
        len => offset + Ipv6Hdr::LEN + usize::from(len),
    };
    let mut offset = offset + Ipv6Hdr::LEN;
    let mut fragment = false;
    let mut first_fragment = false;
    // The source is known from here on: whatever follows, a packet.
    let unreadable = |protocol: u8, fragment: bool, first_fragment: bool, datagram: u64| Packet {
        source: Source::V6(source),
        protocol,
        dest_port: NO_PORT,
        tcp_flags: 0,
        fragment,
        unreadable: true,
        port_unknown: true,
        tiny_fragment: first_fragment,
        first_fragment,
        datagram,
    };
    // Up to MAX extension headers, then one more turn for the transport header.
    for _ in 0..=MAX_IPV6_EXT_HEADERS {
        match next {
            proto::HOP_BY_HOP | proto::ROUTING | proto::DEST_OPTS | proto::AUTH => {
                // Next header, then the length beyond the first 8 bytes:
                // in 4-byte units for AH, in 8-byte units for the others.
                let Ok(ext) = ptr_at::<[u8; 2]>(ctx, offset) else {
                    return Ok(unreadable(
                        UNKNOWN_PROTOCOL,
                        fragment,
                        first_fragment,
                        datagram,
                    ));
                };
                // SAFETY: `ptr_at` checked these two bytes against `data_end` (the
                // `let ... else` above); a byte array, copied out.
                let [following, len] = unsafe { *ext };
                offset += if next == proto::AUTH {
                    (len as usize + 2) * 4
                } else {
                    (len as usize + 1) * 8
                };
                next = following;
            }
            proto::FRAGMENT => {
                let Ok(ext) = ptr_at::<[u8; 8]>(ctx, offset) else {
                    return Ok(unreadable(
                        UNKNOWN_PROTOCOL,
                        fragment,
                        first_fragment,
                        datagram,
                    ));
                };
                // SAFETY: `ptr_at` checked these eight bytes against `data_end` (the
                // `let ... else` above); a byte array, copied out.
                let [following, _, offset_hi, offset_lo, id0, id1, id2, id3] = unsafe { *ext };
                fragment = true;
                datagram =
                    u64::from(folded) << 32 | u64::from(u32::from_ne_bytes([id0, id1, id2, id3]));
                next = following;
                offset += 8;
                if u16::from_be_bytes([offset_hi, offset_lo]) >> 3 != 0 {
                    // A later fragment: no transport header to look at,
                    // and its Next Header is the sender's word (the
                    // receiver reassembles by the first fragment's).
                    return Ok(Packet {
                        source: Source::V6(source),
                        protocol: UNKNOWN_PROTOCOL,
                        dest_port: NO_PORT,
                        tcp_flags: 0,
                        fragment,
                        unreadable: false,
                        port_unknown: true,
                        tiny_fragment: false,
                        first_fragment: false,
                        datagram,
                    });
                }
                // Offset 0 with more to come (not an atomic fragment).
                first_fragment = offset_lo & 1 != 0;
            }
            _ => {
                return Ok(match parse_transport(ctx, offset, ip_end, next) {
                    Ok((dest_port, tcp_flags)) => Packet {
                        source: Source::V6(source),
                        protocol: next,
                        dest_port,
                        tcp_flags,
                        fragment,
                        unreadable: false,
                        port_unknown: false,
                        tiny_fragment: false,
                        first_fragment,
                        datagram,
                    },
                    Err(Malformed) => unreadable(next, fragment, first_fragment, datagram),
                });
            }
        }
    }
    // Still inside the extension-header chain: longer than we walk, so
    // neither protocol nor port is known.
    Ok(unreadable(
        UNKNOWN_PROTOCOL,
        fragment,
        first_fragment,
        datagram,
    ))
}

/// The destination port of a transport header at `offset` (and a TCP
/// segment's flags), requiring the protocol's whole fixed header to be
/// present, within the frame and within the IP datagram (which ends at
/// `ip_end`).
#[inline(always)]
fn parse_transport(
    ctx: &XdpContext,
    offset: usize,
    ip_end: usize,
    protocol: u8,
) -> Result<(u32, u8), Malformed> {
    let header_len = match protocol {
        proto::TCP => 20,
        proto::UDP => 8,
        proto::SCTP => 12,
        proto::ICMP | proto::ICMPV6 => {
            if offset + 4 > ip_end {
                return Err(Malformed);
            }
            ptr_at::<[u8; 4]>(ctx, offset)?;
            return Ok((NO_PORT, 0));
        }
        _ => return Ok((NO_PORT, 0)),
    };
    if offset > MAX_OFFSET
        || offset + header_len > ip_end
        || ctx.data() + offset + header_len > ctx.data_end()
    {
        return Err(Malformed);
    }
    // All three start with source port, destination port. The volatile read
    // keeps LLVM from carrying the packet pointer around instead of the
    // value, which the verifier cannot follow across merged paths.
    let port: *const [u8; 2] = ptr_at(ctx, offset + 2)?;
    // SAFETY: `ptr_at` checked these two bytes against `data_end`; a byte
    // array (alignment 1), read volatile.
    let port = unsafe { core::ptr::read_volatile(port) };
    // TCP's flags byte, within the 20 bytes checked above.
    let tcp_flags = if protocol == proto::TCP {
        let flags: *const u8 = ptr_at(ctx, offset + 13)?;
        // SAFETY: `ptr_at` checked this byte against `data_end`.
        unsafe { core::ptr::read_volatile(flags) }
    } else {
        0
    };
    Ok((u32::from(u16::from_be_bytes(port)), tcp_flags))
}
