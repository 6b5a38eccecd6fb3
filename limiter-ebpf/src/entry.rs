//! The entry program's work: parse the frame, count it, and hand it to
//! the decision program (`decide`). What follows the parser is kept to a
//! few stores: the verifier walks it once per way to parse a frame.

use aya_ebpf::{bindings::xdp_action, programs::XdpContext};
use limiter_common::{
    abi::{GlobalCounters, Handoff, action, handoff_flag},
    trace::{reason, verdict as traced},
};

use crate::{
    handoff,
    maps::{CONFIG, GLOBAL_STATS, IFACES},
    parse::{self, Packet, Source},
    profile,
    trace::{self, Decision},
};

/// The entry program: an IP packet goes on to the decision program; what
/// it decides alone (not IP, malformed) ends here.
#[inline(always)]
pub fn run(ctx: &XdpContext) -> u32 {
    // One per-CPU record counts every packet: looked up once, then plain
    // increments (XDP runs to the end on its CPU).
    let (Some(global), Some(slot)) = (GLOBAL_STATS.get_ptr_mut(0), handoff::slot()) else {
        return xdp_action::XDP_PASS;
    };
    // SAFETY: per-CPU values, which only this CPU's programs touch, one
    // program at a time.
    let (global, handed) = unsafe { (&mut *global, &mut *slot) };
    // A scalar from here on: were LLVM to narrow it to 32 bits, it would
    // spill `data_end` at 32 bits, which the verifier refuses.
    // SAFETY: a local.
    let len = unsafe { core::ptr::read_volatile(&((ctx.data_end() - ctx.data()) as u64)) };
    let Some(config) = CONFIG.get(0) else {
        return xdp_action::XDP_PASS;
    };
    // SAFETY: the verifier allows reading ingress_ifindex from xdp_md.
    let ifindex = unsafe { (*ctx.ctx).ingress_ifindex };
    let iface = IFACES.get(ifindex).copied().unwrap_or(0);
    global.packets += 1;
    if profile::stop_after(profile::CONFIG_READ) {
        return profile::verdict(u64::from(config.generation ^ iface));
    }
    let parsed = parse::parse(ctx);
    if profile::stop_after(profile::PARSED) {
        return profile::verdict(parsed.map_or(1, |p| p.map_or(2, |p| u64::from(p.dest_port))));
    }
    handed.len = len as u32;
    handed.iface = iface;
    // Read once: userspace flips it at any time, and a packet is judged
    // wholly by one generation's rules.
    // SAFETY: an aligned u32 in a map value; a volatile read is one load.
    handed.generation = unsafe { core::ptr::read_volatile(&config.generation) };
    let decision = match &parsed {
        Ok(Some(packet)) => {
            record(global, handed, packet);
            // Returns only if the decision program is not there.
            handoff::hand_over(ctx);
            Decision::new(action::PASS, traced::PASSED, reason::NONE)
        }
        Ok(None) => {
            // Not IP: no source to limit or to trace.
            global.non_ip += 1;
            return xdp_action::XDP_PASS;
        }
        Err(parse::Malformed) => {
            global.malformed += 1;
            handed.flags = 0;
            Decision::new(config.malformed_action, traced::MALFORMED, reason::NONE)
        }
    };
    trace::finish(ctx, &decision)
}

/// Counts an IP packet and writes what the decision program needs of it.
#[inline(always)]
fn record(global: &mut GlobalCounters, handed: &mut Handoff, packet: &Packet) {
    let mut flags = handoff_flag::IP;
    match packet.source {
        Source::V4(addr) => {
            global.ipv4 += 1;
            // As one word: the BPF target writes byte arrays byte by byte.
            // SAFETY: the first 4 of 16 bytes; u8 arrays have alignment 1.
            unsafe {
                (&raw mut handed.addr)
                    .cast::<[u8; 4]>()
                    .write_unaligned(addr)
            };
        }
        Source::V6(addr) => {
            global.ipv6 += 1;
            handed.addr = addr;
            flags |= handoff_flag::V6;
        }
    }
    if packet.fragment {
        global.fragments += 1;
    }
    if packet.unreadable {
        global.unreadable_transport += 1;
    }
    if packet.first_fragment {
        flags |= handoff_flag::FIRST_FRAGMENT;
    }
    if packet.later_fragment() {
        flags |= handoff_flag::LATER_FRAGMENT;
    }
    if packet.port_unknown {
        flags |= handoff_flag::PORT_UNKNOWN;
    }
    if packet.tiny_fragment {
        flags |= handoff_flag::TINY_FRAGMENT;
    }
    handed.flags = flags;
    handed.protocol = packet.protocol;
    handed.dest_port = packet.dest_port;
    handed.tcp_flags = packet.tcp_flags;
    handed.datagram = packet.datagram;
}
