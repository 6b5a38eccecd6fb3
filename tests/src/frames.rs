//! Crafted frames for BPF_PROG_TEST_RUN: valid ones from etherparse, and
//! the tagged, extended, fragmented and broken variants built by hand.

use std::net::{Ipv4Addr, Ipv6Addr};

use etherparse::PacketBuilder;

const SRC_MAC: [u8; 6] = [2, 0, 0, 0, 0, 1];
const DST_MAC: [u8; 6] = [2, 0, 0, 0, 0, 2];
const DST_V4: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 2);
const DST_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, 2);

/// Offset of the IP header in an untagged frame.
pub const L3: usize = 14;

pub fn udp4(src: Ipv4Addr, dest_port: u16, payload: usize) -> Vec<u8> {
    let mut frame = Vec::new();
    PacketBuilder::ethernet2(SRC_MAC, DST_MAC)
        .ipv4(src.octets(), DST_V4.octets(), 64)
        .udp(40000, dest_port)
        .write(&mut frame, &vec![0; payload])
        .expect("vec write");
    frame
}

pub fn tcp4(src: Ipv4Addr, dest_port: u16) -> Vec<u8> {
    let mut frame = Vec::new();
    PacketBuilder::ethernet2(SRC_MAC, DST_MAC)
        .ipv4(src.octets(), DST_V4.octets(), 64)
        .tcp(40000, dest_port, 1, 1024)
        .write(&mut frame, &[])
        .expect("vec write");
    frame
}

pub fn udp6(src: Ipv6Addr, dest_port: u16, payload: usize) -> Vec<u8> {
    let mut frame = Vec::new();
    PacketBuilder::ethernet2(SRC_MAC, DST_MAC)
        .ipv6(src.octets(), DST_V6.octets(), 64)
        .udp(40000, dest_port)
        .write(&mut frame, &vec![0; payload])
        .expect("vec write");
    frame
}

pub fn tcp6(src: Ipv6Addr, dest_port: u16) -> Vec<u8> {
    let mut frame = Vec::new();
    PacketBuilder::ethernet2(SRC_MAC, DST_MAC)
        .ipv6(src.octets(), DST_V6.octets(), 64)
        .tcp(40000, dest_port, 1, 1024)
        .write(&mut frame, &[])
        .expect("vec write");
    frame
}

/// An ICMP echo request.
pub fn icmp4(src: Ipv4Addr) -> Vec<u8> {
    let mut frame = Vec::new();
    PacketBuilder::ethernet2(SRC_MAC, DST_MAC)
        .ipv4(src.octets(), DST_V4.octets(), 64)
        .icmpv4_echo_request(1, 1)
        .write(&mut frame, &[0; 8])
        .expect("vec write");
    frame
}

/// An ICMPv6 echo request.
pub fn icmp6(src: Ipv6Addr) -> Vec<u8> {
    let mut frame = Vec::new();
    PacketBuilder::ethernet2(SRC_MAC, DST_MAC)
        .ipv6(src.octets(), DST_V6.octets(), 64)
        .icmpv6_echo_request(1, 1)
        .write(&mut frame, &[0; 8])
        .expect("vec write");
    frame
}

pub fn arp() -> Vec<u8> {
    let mut frame = Vec::new();
    frame.extend_from_slice(&[0xff; 6]);
    frame.extend_from_slice(&SRC_MAC);
    frame.extend_from_slice(&[0x08, 0x06]);
    frame.extend_from_slice(&[0, 1, 8, 0, 6, 4, 0, 1]);
    frame.extend_from_slice(&[0; 20]);
    frame
}

/// Inserts a VLAN tag (`tpid` 0x8100 or 0x88a8) after the MAC addresses.
pub fn tagged(frame: &[u8], tpid: u16, vid: u16) -> Vec<u8> {
    let mut out = frame[..12].to_vec();
    out.extend_from_slice(&tpid.to_be_bytes());
    out.extend_from_slice(&vid.to_be_bytes());
    out.extend_from_slice(&frame[12..]);
    out
}

/// Adds `words` 32-bit words of IPv4 options (NOPs) to an untagged IPv4 frame.
pub fn with_ipv4_options(frame: &[u8], words: u8) -> Vec<u8> {
    let ihl = frame[L3] & 0x0f;
    let header_end = L3 + usize::from(ihl) * 4;
    let mut out = frame[..header_end].to_vec();
    out.extend(std::iter::repeat_n(1u8, usize::from(words) * 4));
    out.extend_from_slice(&frame[header_end..]);
    out[L3] = 0x40 | (ihl + words);
    let total = u16::from_be_bytes([out[L3 + 2], out[L3 + 3]]) + u16::from(words) * 4;
    out[L3 + 2..L3 + 4].copy_from_slice(&total.to_be_bytes());
    out
}

/// Sets an IPv4 frame's fragment field: `more` fragments flag, offset in 8-byte units.
pub fn ipv4_fragment(frame: &[u8], more: bool, offset: u16) -> Vec<u8> {
    let mut out = frame.to_vec();
    let field = offset | if more { 0x2000 } else { 0 };
    out[L3 + 6..L3 + 8].copy_from_slice(&field.to_be_bytes());
    out
}

/// An untagged IPv4 frame with an authentication header (RFC 4302, 24
/// bytes: a 12-byte ICV, length field 4) between the IP header and what
/// it carried.
pub fn ipv4_ah(frame: &[u8]) -> Vec<u8> {
    const AH: u8 = 51;
    let ihl = frame[L3] & 0x0f;
    let header_end = L3 + usize::from(ihl) * 4;
    let mut out = frame[..header_end].to_vec();
    out.extend_from_slice(&[frame[L3 + 9], 4, 0, 0]);
    out.extend_from_slice(&[0; 20]);
    out.extend_from_slice(&frame[header_end..]);
    out[L3 + 9] = AH;
    let total = u16::from_be_bytes([out[L3 + 2], out[L3 + 3]]) + 24;
    out[L3 + 2..L3 + 4].copy_from_slice(&total.to_be_bytes());
    out
}

/// IPv6 extension headers for [`ipv6_chain`].
#[derive(Clone, Copy)]
pub enum Ext {
    HopByHop,
    Routing,
    DestOpts,
    /// An authentication header with a 12-byte ICV (24 bytes, length 4).
    Auth,
    /// A fragment header with this offset (8-byte units) and more-fragments flag.
    Fragment {
        offset: u16,
        more: bool,
    },
}

/// A UDP datagram to `dest_port` behind a chain of IPv6 extension headers.
pub fn ipv6_chain(src: Ipv6Addr, chain: &[Ext], dest_port: u16) -> Vec<u8> {
    const UDP: u8 = 17;
    let number = |ext: &Ext| match ext {
        Ext::HopByHop => 0,
        Ext::Routing => 43,
        Ext::DestOpts => 60,
        Ext::Auth => 51,
        Ext::Fragment { .. } => 44,
    };
    let mut payload = Vec::new();
    for (i, ext) in chain.iter().enumerate() {
        let next = chain.get(i + 1).map_or(UDP, number);
        match ext {
            // 16 bytes (length field 1): long enough to prove the length is honoured.
            Ext::HopByHop | Ext::DestOpts => {
                payload.extend_from_slice(&[next, 1, 1, 12]);
                payload.extend_from_slice(&[0; 12]);
            }
            // Type 0 routing header with no addresses left.
            Ext::Routing => payload.extend_from_slice(&[next, 0, 0, 0, 0, 0, 0, 0]),
            // Length in 4-byte units, minus 2: 24 bytes.
            Ext::Auth => {
                payload.extend_from_slice(&[next, 4, 0, 0]);
                payload.extend_from_slice(&[0; 20]);
            }
            Ext::Fragment { offset, more } => {
                let field = (offset << 3) | u16::from(*more);
                payload.extend_from_slice(&[next, 0]);
                payload.extend_from_slice(&field.to_be_bytes());
                payload.extend_from_slice(&[0, 0, 0, 7]);
            }
        }
    }
    payload.extend_from_slice(&40000u16.to_be_bytes());
    payload.extend_from_slice(&dest_port.to_be_bytes());
    payload.extend_from_slice(&[0, 8, 0, 0]);
    let mut frame = Vec::new();
    frame.extend_from_slice(&DST_MAC);
    frame.extend_from_slice(&SRC_MAC);
    frame.extend_from_slice(&[0x86, 0xdd]);
    frame.extend_from_slice(&[0x60, 0, 0, 0]);
    frame.extend_from_slice(&(payload.len() as u16).to_be_bytes());
    frame.push(chain.first().map_or(UDP, number));
    frame.push(64);
    frame.extend_from_slice(&src.octets());
    frame.extend_from_slice(&DST_V6.octets());
    frame.extend_from_slice(&payload);
    frame
}

/// A TCP frame of [`tcp4`] or [`tcp6`] with its flags byte set to
/// `flags` (its checksum left as it was: the limiter reads none).
pub fn with_tcp_flags(mut frame: Vec<u8>, flags: u8) -> Vec<u8> {
    let ip_header = if frame[12..14] == [0x86, 0xdd] {
        40
    } else {
        20
    };
    frame[L3 + ip_header + 13] = flags;
    frame
}
