//! `limiter trace`: while someone traces, the limiter hands each decision
//! to the trace program by a tail call, which filters it, samples it and
//! sends it to the ring buffer. So a packet nobody traces pays one load
//! and one branch, and the trace program's code is verified on its own,
//! not once per path through the limiter.
//!
//! A ring buffer of fixed records rather than `aya-log`: the tracer
//! filters, samples, counts losses and prints text or JSON from typed
//! fields, and computes what is left of a budget from the meters' state;
//! aya-log carries formatted log lines to a logger.

use aya_ebpf::{
    bindings::xdp_action, helpers::bpf_get_prandom_u32, macros::xdp, programs::XdpContext,
};
use limiter_common::{
    abi::{FlowKey, KeyState, action, handoff_flag, rule_slot},
    trace::TraceEvent,
};

use crate::{
    handoff, keys,
    maps::{
        AGGREGATES, CONFIG, RULES, TRACE, TRACE_COUNTS, TRACE_EVENTS, TRACE_PROG, TRACE_SCRATCH,
    },
    parse::Source,
};

/// Builds without any tracing code (`LIMITER_NO_TRACE=1`), for the
/// benchmark that shows what the idle branch costs.
const COMPILED: bool = option_env!("LIMITER_NO_TRACE").is_none();

/// What the limiter decided of a packet: all it hands over. The trace
/// program finds the rest again (the source, the rule, the key): so only
/// two small values stay live to the end of the limiter, and the
/// verifier's pruning of its paths is kept.
#[derive(Clone, Copy)]
pub struct Decision {
    /// `abi::action`.
    pub action: u32,
    /// `trace::verdict` | `trace::reason` << 8.
    why: u32,
}

impl Decision {
    #[inline(always)]
    pub fn new(action: u32, verdict: u8, reason: u8) -> Self {
        Self {
            action,
            why: u32::from(verdict) | u32::from(reason) << 8,
        }
    }

    /// `trace::reason` of a refused packet (`NONE` if it passed).
    #[inline(always)]
    pub fn reason(&self) -> u8 {
        (self.why >> 8) as u8
    }

    /// In one word, for the program a decision is handed to.
    #[inline(always)]
    pub fn packed(&self) -> u32 {
        (self.action & 0xff) | self.why << 8
    }

    #[inline(always)]
    pub fn unpacked(word: u32) -> Self {
        Self {
            action: word & 0xff,
            why: word >> 8,
        }
    }
}

/// Whether someone traces.
#[inline(always)]
pub fn on() -> bool {
    COMPILED
        && TRACE
            .get(0)
            // SAFETY: `on` is an aligned u32 of the `TRACE` map value, which the
            // tracer rewrites at any time: one volatile load.
            .is_some_and(|t| unsafe { core::ptr::read_volatile(&t.on) } != 0)
}

/// Hands the decision to the trace program, which returns the packet's
/// verdict; returns only if the trace program is not there.
#[inline(always)]
pub fn hand_over(ctx: &XdpContext, decided: &Decision) {
    let Some(event) = TRACE_SCRATCH.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: `event` is this CPU's `TRACE_SCRATCH` value, which only this
    // CPU's running program touches (XDP runs to the end on its CPU, tail
    // calls included); the tail call hands this XDP program's own context to
    // an XDP program (`limiter_trace`), and returns only if it failed.
    unsafe {
        (*event).time_ns = u64::from(decided.packed());
        TRACE_PROG.tail_call(ctx, 0);
    }
}

/// Ends a program with its decision: handed to the trace program first
/// while someone traces (which then returns the verdict itself).
#[inline(always)]
pub fn finish(ctx: &XdpContext, decided: &Decision) -> u32 {
    if on() {
        hand_over(ctx, decided);
    }
    if decided.action == action::DROP {
        xdp_action::XDP_DROP
    } else {
        xdp_action::XDP_PASS
    }
}

/// The trace program: the decision the limiter handed over (in
/// `time_ns`), completed from the packet as the entry program parsed it
/// and the decision program matched it (`abi::Handoff`) and from the key
/// table, filtered, sampled and sent; returns the packet's verdict, which
/// was decided already.
#[xdp]
pub fn limiter_trace(ctx: XdpContext) -> u32 {
    let Some(event) = TRACE_SCRATCH.get_ptr_mut(0) else {
        return xdp_action::XDP_PASS;
    };
    // SAFETY: a per-CPU value; XDP runs to the end on its CPU.
    let event = unsafe { &mut *event };
    let packed = event.time_ns;
    let dropped = packed & 0xff == u64::from(action::DROP);
    let verdict = if dropped {
        xdp_action::XDP_DROP
    } else {
        xdp_action::XDP_PASS
    };
    let (Some(config), Some(global)) = (TRACE.get(0), CONFIG.get(0)) else {
        return verdict;
    };
    event.dropped = u8::from(dropped);
    event.verdict = (packed >> 8) as u8;
    event.reason = (packed >> 16) as u8;
    // SAFETY: an aligned u32 of the `CONFIG` map value, which userspace flips
    // at any time: one volatile load.
    event.generation = unsafe { core::ptr::read_volatile(&global.generation) };
    event.rule = 0;
    // SAFETY: `ctx.ctx` is the xdp_md the kernel passed this program; the
    // verifier allows reading its ingress_ifindex.
    event.ifindex = unsafe { (*ctx.ctx).ingress_ifindex };
    event.len = (ctx.data_end() - ctx.data()) as u32;
    event.family = 0;
    event.protocol = 0;
    event.dest_port = 0;
    event.has_key = 0;
    event.key_state = [0; 3];
    // Words, not bytes: the BPF target copies byte arrays byte by byte.
    // SAFETY: `addr` is 16 bytes; the event is a per-CPU map value.
    let addr = unsafe { &mut *(&raw mut event.addr).cast::<[u32; 4]>() };
    *addr = [0; 4];
    // The packet as the entry program parsed it (and the decision program
    // matched it): written for this very packet whenever it is IP.
    if let Some(handed) = handoff::received()
        && handed.flags & handoff_flag::IP != 0
    {
        event.generation = handed.generation;
        event.rule = handed.rule;
        event.protocol = handed.protocol;
        event.dest_port = handed.dest_port;
        let rule = RULES.get(rule_slot(handed.generation, handed.rule));
        let key = match handoff::source(handed) {
            Source::V4(a) => {
                event.family = 4;
                addr[0] = u32::from_ne_bytes(a);
                rule.map(|rule| FlowKey::v4(handed.rule, a, rule.v4_key_mask))
            }
            Source::V6(a) => {
                event.family = 6;
                for (i, word) in addr.iter_mut().enumerate() {
                    *word =
                        u32::from_ne_bytes([a[4 * i], a[4 * i + 1], a[4 * i + 2], a[4 * i + 3]]);
                }
                rule.map(|rule| FlowKey::v6(handed.rule, a, rule.v6_key_mask))
            }
        };
        if let Some(slot) = key.and_then(|key| keys::find(global, &key)) {
            // SAFETY: a slot of the key table; a copy of its words.
            let state: &KeyState = unsafe { &(*slot.as_ptr()).state };
            event.key_state = state.meters;
            event.has_key = 1;
        }
    }
    // SAFETY: bpf_get_prandom_u32 takes no arguments and touches no memory.
    if !config.wants(event) || !config.sampled(unsafe { bpf_get_prandom_u32() }) {
        return verdict;
    }
    event.time_ns = crate::clock::now();
    event.aggregate = AGGREGATES
        .get(event.rule)
        .map_or([[0; 3]; 2], |aggregate| aggregate.meters);
    let sent = TRACE_EVENTS.output::<TraceEvent>(&*event, 0).is_ok();
    if let Some(counts) = TRACE_COUNTS.get_ptr_mut(0) {
        // SAFETY: this CPU's `TRACE_COUNTS` value, which only this CPU's running
        // program touches (XDP runs to the end on its CPU).
        let counts = unsafe { &mut *counts };
        counts[usize::from(!sent)] += 1;
    }
    verdict
}
