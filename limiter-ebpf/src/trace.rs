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
    abi::{FlowKey, KeyState, action, rule_slot},
    trace::TraceEvent,
};

use crate::{
    keys,
    maps::{
        AGGREGATES, CONFIG, RULES, TRACE, TRACE_COUNTS, TRACE_EVENTS, TRACE_PROG, TRACE_SCRATCH,
    },
    parse::{self, Source},
};

/// Builds without any tracing code (`LIMITER_NO_TRACE=1`), for the
/// benchmark that shows what the idle branch costs.
const COMPILED: bool = option_env!("LIMITER_NO_TRACE").is_none();

/// What the limiter decided of a packet: all it hands over. The trace
/// program finds the rest again (the source, the rule, the key): so only
/// two small values stay live to the end of the limiter, and the
/// verifier's pruning of its paths is kept.
#[derive(Clone, Copy)]
pub struct Decided {
    /// `abi::action`.
    pub action: u32,
    /// `trace::verdict` | `trace::reason` << 8.
    why: u32,
}

impl Decided {
    #[inline(always)]
    pub fn new(action: u32, verdict: u8, reason: u8) -> Self {
        Self {
            action,
            why: u32::from(verdict) | u32::from(reason) << 8,
        }
    }
}

/// Whether someone traces.
#[inline(always)]
pub fn on() -> bool {
    COMPILED
        && TRACE
            .get(0)
            .is_some_and(|t| unsafe { core::ptr::read_volatile(&t.on) } != 0)
}

/// Hands the decision to the trace program, which returns the packet's
/// verdict; returns only if the trace program is not there.
#[inline(always)]
pub fn hand_over(ctx: &XdpContext, decided: &Decided) {
    let Some(event) = TRACE_SCRATCH.get_ptr_mut(0) else {
        return;
    };
    unsafe {
        (*event).time_ns = u64::from(decided.action & 1) | u64::from(decided.why) << 8;
        TRACE_PROG.tail_call(ctx, 0);
    }
}

/// The trace program: the decision the limiter handed over (in
/// `time_ns`), completed from the frame (parsed again), the rule tables
/// and the key table as the limiter found them, filtered, sampled and
/// sent; returns the packet's verdict, which was decided already. (A rule
/// set applied in between, nanoseconds, shows the new rule.)
#[xdp]
pub fn limiter_trace(ctx: XdpContext) -> u32 {
    let Some(event) = TRACE_SCRATCH.get_ptr_mut(0) else {
        return xdp_action::XDP_PASS;
    };
    let event = unsafe { &mut *event };
    let packed = event.time_ns;
    let dropped = packed & 1 == u64::from(action::DROP);
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
    event.generation = unsafe { core::ptr::read_volatile(&global.generation) };
    event.rule = 0;
    event.ifindex = unsafe { (*ctx.ctx).ingress_ifindex };
    event.len = (ctx.data_end() - ctx.data()) as u32;
    event.family = 0;
    event.protocol = 0;
    event.dest_port = 0;
    event.has_key = 0;
    event.key_state = [0; 3];
    // Words, not bytes: the BPF target copies byte arrays byte by byte.
    let addr = unsafe { &mut *(&raw mut event.addr).cast::<[u32; 4]>() };
    *addr = [0; 4];
    if let Ok(Some(packet)) = parse::parse(&ctx) {
        event.rule = match fragments_first(event.generation, &packet) {
            Some(rule) => rule,
            None => crate::match_rule(event.generation, &packet),
        };
        let rule = RULES.get(rule_slot(event.generation, event.rule));
        event.protocol = packet.protocol;
        event.dest_port = packet.dest_port;
        let key = match packet.source {
            Source::V4(a) => {
                event.family = 4;
                addr[0] = u32::from_ne_bytes(a);
                rule.map(|rule| FlowKey::v4(event.rule, a, rule.v4_key_mask))
            }
            Source::V6(a) => {
                event.family = 6;
                for (i, word) in addr.iter_mut().enumerate() {
                    *word =
                        u32::from_ne_bytes([a[4 * i], a[4 * i + 1], a[4 * i + 2], a[4 * i + 3]]);
                }
                rule.map(|rule| FlowKey::v6(event.rule, a, rule.v6_key_mask))
            }
        };
        if let Some(slot) = key.and_then(|key| keys::find(global, &key)) {
            let state: &KeyState = unsafe { &(*slot.as_ptr()).state };
            event.key_state = state.meters;
            event.has_key = 1;
        }
    }
    if !config.wants(event) || !config.sampled(unsafe { bpf_get_prandom_u32() }) {
        return verdict;
    }
    event.time_ns = crate::clock::now();
    event.aggregate = AGGREGATES
        .get(event.rule)
        .map_or([[0; 3]; 2], |aggregate| aggregate.meters);
    let sent = TRACE_EVENTS.output::<TraceEvent>(&*event, 0).is_ok();
    if let Some(counts) = TRACE_COUNTS.get_ptr_mut(0) {
        let counts = unsafe { &mut *counts };
        counts[usize::from(!sent)] += 1;
    }
    verdict
}

/// The rule of a later fragment's first fragment, which it follows.
#[inline(always)]
fn fragments_first(generation: u32, packet: &parse::Packet) -> Option<u32> {
    if !packet.later_fragment() {
        return None;
    }
    crate::fragments::first_of(generation, packet).map(|first| first.rule)
}
