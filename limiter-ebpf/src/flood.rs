//! Benchmark helpers, not part of the limiter: `flood` turns one crafted
//! IPv4 frame into a flood from many sources (rewriting the source address
//! per frame, checksum kept valid) and sends it back out (XDP_TX) when run
//! through BPF_PROG_TEST_RUN in live-frames mode; `pass` lets every frame
//! through, so a receiving veth accepts XDP_TX frames when the limiter
//! under test is netfilter rather than XDP; `drop_all` is the baseline.
#![no_std]
#![no_main]

mod runtime;

use aya_ebpf::{
    bindings::xdp_action,
    macros::{map, xdp},
    maps::{Array, PerCpuArray},
    programs::XdpContext,
};

/// Index 0: how many sources to cycle through.
#[map]
static FLOOD_SOURCES: Array<u32> = Array::with_max_entries(1, 0);

#[map]
static FLOOD_NEXT: PerCpuArray<u32> = PerCpuArray::with_max_entries(1, 0);

/// Offset of the IPv4 header checksum and of the source's low 16 bits.
const CHECKSUM: usize = 14 + 10;
const SOURCE_LOW: usize = 14 + 14;

#[xdp]
pub fn flood(ctx: XdpContext) -> u32 {
    let (start, end) = (ctx.data(), ctx.data_end());
    if start + SOURCE_LOW + 2 > end {
        return xdp_action::XDP_ABORTED;
    }
    let sources = FLOOD_SOURCES.get(0).copied().unwrap_or(1).max(1);
    let Some(next) = FLOOD_NEXT.get_ptr_mut(0) else {
        return xdp_action::XDP_ABORTED;
    };
    let n = unsafe {
        let n = *next;
        *next = if n + 1 >= sources { 0 } else { n + 1 };
        n as u16
    };
    let low = (start + SOURCE_LOW) as *mut [u8; 2];
    let checksum = (start + CHECKSUM) as *mut [u8; 2];
    unsafe {
        let old = u16::from_be_bytes(*low);
        let new = n;
        // RFC 1624: HC' = ~(~HC + ~m + m').
        let hc = u16::from_be_bytes(*checksum);
        let mut sum = u32::from(!hc) + u32::from(!old) + u32::from(new);
        sum = (sum & 0xffff) + (sum >> 16);
        sum = (sum & 0xffff) + (sum >> 16);
        *low = new.to_be_bytes();
        *checksum = (!(sum as u16)).to_be_bytes();
    }
    xdp_action::XDP_TX
}

#[xdp]
pub fn pass(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_PASS
}

/// The cheapest possible receiver: the baseline the others are measured
/// against (what the generator itself costs).
#[xdp]
pub fn drop_all(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_DROP
}
