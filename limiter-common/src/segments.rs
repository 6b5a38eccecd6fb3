//! How many frames a packet stands for. Native XDP sees every frame as
//! it arrived; skb (generic) mode sees socket buffers, and one of those
//! may be many frames' worth: a buffer a local sender or a veth peer
//! segments only later (GSO, TSO), or one GRO merged. A packet limit is a
//! limit on frames, so such a buffer is charged the full-size segments it
//! carries.

/// What may precede the IP header of a frame no longer than the MTU:
/// Ethernet and two VLAN tags.
pub const LINK_HEADERS: u64 = 14 + 8;
/// The headers each segment repeats, as TCP over IPv4 with timestamps
/// sends them (Ethernet 14, IPv4 20, TCP 32): the most common bulk, and
/// segments of the others are within a few percent of it.
pub const SEGMENT_HEADERS: u64 = 14 + 20 + 32;

/// The frames a packet of `len` bytes stands for on an interface of
/// `mtu` bytes (0: unknown, so one): one unless it is longer than any
/// frame the interface carries, else the full segments of
/// `mtu − (IPv4 + TCP headers)` bytes of payload its bytes past one set of
/// headers make.
#[inline(always)]
pub fn frames(len: u64, mtu: u64) -> u64 {
    let payload = mtu.saturating_sub(SEGMENT_HEADERS - 14);
    if payload == 0 || len <= mtu + LINK_HEADERS {
        return 1;
    }
    (len - SEGMENT_HEADERS).div_ceil(payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_of_full_segments_counts_each_of_them() {
        // Frames of the interface, tagged or not: one each.
        for len in [60, 1514, 1518, 1522] {
            assert_eq!(frames(len, 1500), 1, "{len}");
        }
        // TCP/IPv4 with timestamps: n segments of 1,448 bytes behind one
        // set of 66 bytes of headers.
        for n in [2, 10, 44] {
            assert_eq!(frames(66 + 1448 * n, 1500), n, "{n} segments");
            // The last segment short.
            assert_eq!(frames(66 + 1448 * (n - 1) + 100, 1500), n);
        }
        // A jumbo interface's frames are frames.
        assert_eq!(frames(9014, 9000), 1);
        assert_eq!(frames(66 + 8948 * 7, 9000), 7);
        // Unknown MTU: one.
        assert_eq!(frames(65_000, 0), 1);
    }
}
