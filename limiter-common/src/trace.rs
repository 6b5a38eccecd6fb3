//! Live decisions (`limiter trace`): the record of one decision as the
//! kernel's trace program and layer 7 report it, and the filter both apply
//! before sampling. The kernel hands a decision over only while someone
//! traces (`TraceConfig::on`), so a packet nobody traces pays one branch.

/// What became of a packet or request (`TraceEvent::verdict`).
pub mod verdict {
    /// Within its limits (or no limit applies): passed.
    pub const PASSED: u8 = 0;
    /// Refused, and the rule's action applied: dropped (429 at layer 7).
    pub const DROPPED: u8 = 1;
    /// Refused, but passed: the rule or everything runs as a dry run.
    pub const SHADOW: u8 = 2;
    /// Its source is blocked (`limiter block`): dropped.
    pub const BLOCKED: u8 = 3;
    /// The frame could not be parsed (or hides its ports: a tiny fragment).
    pub const MALFORMED: u8 = 4;
    /// Verdicts there are: `TraceConfig::verdicts` has a bit each.
    pub const COUNT: u8 = 5;

    /// Every verdict's bit.
    pub const ALL: u32 = (1 << COUNT) - 1;

    /// The verdict's name, as `limiter trace` prints and parses it.
    pub const fn name(verdict: u8) -> &'static str {
        match verdict {
            PASSED => "passed",
            DROPPED => "dropped",
            SHADOW => "shadow",
            BLOCKED => "blocked",
            MALFORMED => "malformed",
            _ => "unknown",
        }
    }
}

/// Why a packet was refused (`TraceEvent::reason`): 0 to 3 name the meter
/// that refused (`meter::order`: key packets, key bytes, aggregate
/// packets, aggregate bytes); the others are below.
pub mod reason {
    /// A new source refused a key by the rule's key-creation budget.
    pub const UNADMITTED: u8 = 4;
    /// A new source whose bucket of the key table had no slot to give.
    pub const NO_SLOT: u8 = 5;
    /// The rule's action is `block`.
    pub const RULE_BLOCKS: u8 = 6;
    /// A later fragment, following its first fragment's fate.
    pub const FRAGMENT: u8 = 7;
    /// A first fragment too short for its transport header.
    pub const TINY_FRAGMENT: u8 = 8;
    /// A manual block covers the source.
    pub const BLOCK: u8 = 9;
    /// Layer 7: the key had as many requests in flight as its rule's
    /// `concurrent` allows.
    pub const IN_FLIGHT: u8 = 10;
    /// Layer 7: the key is blocked by its rule's `escalate`. (In the
    /// kernel an escalation is a block: [`BLOCK`].)
    pub const ESCALATED: u8 = 11;
    /// The key's third limit (`crate::meter::order::KEY_THIRD`).
    pub const THIRD_LIMIT: u8 = 12;
    const _: () = assert!(THIRD_LIMIT as usize == crate::meter::order::KEY_THIRD);
    /// The kernel: every update of the packet's meters (or every try of
    /// its key's window lock) lost to other CPUs; treated as excess.
    pub const CONTENDED: u8 = 13;
    /// A later fragment whose first fragment was not seen, under the rule
    /// file's `fragments: drop`.
    pub const ORPHAN_FRAGMENT: u8 = 14;
    /// Nothing refused the packet (passed, or malformed).
    pub const NONE: u8 = 0xff;

    /// The reason's name, as `limiter trace` prints it.
    pub const fn name(reason: u8) -> &'static str {
        match reason {
            0 => "key packets",
            1 => "key bytes",
            2 => "aggregate packets",
            3 => "aggregate bytes",
            UNADMITTED => "key creation budget",
            NO_SLOT => "key table bucket full",
            RULE_BLOCKS => "rule action block",
            FRAGMENT => "first fragment's fate",
            TINY_FRAGMENT => "tiny fragment",
            BLOCK => "block (limiter block or escalation)",
            IN_FLIGHT => "requests in flight",
            ESCALATED => "escalation block",
            THIRD_LIMIT => "key third limit",
            CONTENDED => "contended (lost every update to other CPUs)",
            ORPHAN_FRAGMENT => "later fragment, first not seen (fragments: drop)",
            _ => "",
        }
    }
}

/// `TraceConfig::rule` that traces every rule.
pub const ANY_RULE: u32 = u32::MAX;

/// What to trace: one entry, written whole by the one tracer (a lock in
/// the pin directory keeps it one), read by the kernel per packet for
/// `on` alone while nobody traces.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TraceConfig {
    /// 0: nobody traces; the program hands nothing over.
    pub on: u32,
    /// Keep one matching decision in `sample` (0 and 1: every one).
    pub sample: u32,
    /// The rule id to trace, or [`ANY_RULE`].
    pub rule: u32,
    /// A bit per [`verdict`] to trace.
    pub verdicts: u32,
    /// The interface index to trace, or 0 for every one.
    pub ifindex: u32,
    /// Source prefix: 0 any source, 4 or 6 that family's `addr`/`prefix_len`.
    pub family: u8,
    pub prefix_len: u8,
    pub _pad: [u8; 2],
    /// The prefix's address, network byte order (IPv4 in the first 4).
    pub addr: [u8; 16],
}

const _: () = assert!(core::mem::size_of::<TraceConfig>() == 40);

impl TraceConfig {
    /// Whether a decision passes the filter (sampling aside).
    #[inline(always)]
    pub fn wants(&self, event: &TraceEvent) -> bool {
        (self.rule == ANY_RULE || self.rule == event.rule)
            && self.verdicts & (1 << (event.verdict & 31)) != 0
            && (self.ifindex == 0 || self.ifindex == event.ifindex)
            && (self.family == 0
                || (self.family == event.family
                    && prefix_matches(&self.addr, self.prefix_len, &event.addr)))
    }

    /// Whether a decision that passed the filter is kept, given a random
    /// number: one in `sample`.
    #[inline(always)]
    pub fn sampled(&self, random: u32) -> bool {
        self.sample <= 1 || random.is_multiple_of(self.sample)
    }
}

/// Whether the first `len` bits of `addr` equal those of `prefix`.
#[inline(always)]
pub fn prefix_matches(prefix: &[u8; 16], len: u8, addr: &[u8; 16]) -> bool {
    let mut differ = 0u8;
    let mut i = 0;
    while i < 16 {
        let bits = (len as i32 - 8 * i as i32).clamp(0, 8);
        let mask = (0xff00u16 >> bits) as u8;
        differ |= (prefix[i] ^ addr[i]) & mask;
        i += 1;
    }
    differ == 0
}

/// One decision, as the ring buffer carries it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TraceEvent {
    /// When it was traced, ns of `CLOCK_MONOTONIC`.
    pub time_ns: u64,
    /// The key's meters after the decision (`KeyState::meters`), when the
    /// packet had a key (`has_key`).
    pub key_state: [u64; 3],
    /// The rule's aggregate meters after it (`AggregateState::meters`).
    pub aggregate: [[u64; 3]; 2],
    /// The source, network byte order (IPv4 in the first 4 bytes).
    pub addr: [u8; 16],
    pub ifindex: u32,
    /// The rule id, in `generation`'s rule table.
    pub rule: u32,
    pub generation: u32,
    /// The frame's length (Ethernet header included).
    pub len: u32,
    /// Destination port, or `abi::NO_PORT`.
    pub dest_port: u32,
    /// 4, 6, or 0 (malformed: no source).
    pub family: u8,
    pub protocol: u8,
    pub verdict: u8,
    pub reason: u8,
    /// 1 when the packet was dropped.
    pub dropped: u8,
    pub has_key: u8,
    pub _pad: [u8; 2],
}

const _: () = assert!(core::mem::size_of::<TraceEvent>() == 128);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_verdict_and_reason_has_a_name_of_its_own() {
        extern crate std;
        use std::collections::BTreeSet;
        let verdicts: BTreeSet<&str> = (0..verdict::COUNT).map(verdict::name).collect();
        assert_eq!(verdicts.len(), usize::from(verdict::COUNT));
        assert!(verdicts.iter().all(|n| !n.is_empty() && *n != "unknown"));
        assert_eq!(verdict::name(verdict::DROPPED), "dropped");
        let reasons: BTreeSet<&str> = (0..=reason::ORPHAN_FRAGMENT).map(reason::name).collect();
        assert_eq!(reasons.len(), usize::from(reason::ORPHAN_FRAGMENT) + 1);
        assert!(reasons.iter().all(|n| !n.is_empty()));
        assert_eq!(reason::name(reason::NONE), "");
    }

    fn event(family: u8, addr: [u8; 4]) -> TraceEvent {
        let mut e = TraceEvent {
            family,
            rule: 3,
            verdict: verdict::DROPPED,
            ifindex: 7,
            ..TraceEvent::default()
        };
        e.addr[..4].copy_from_slice(&addr);
        e
    }

    fn config(prefix: [u8; 4], len: u8) -> TraceConfig {
        let mut c = TraceConfig {
            on: 1,
            rule: ANY_RULE,
            verdicts: verdict::ALL,
            family: 4,
            prefix_len: len,
            ..TraceConfig::default()
        };
        c.addr[..4].copy_from_slice(&prefix);
        c
    }

    #[test]
    fn prefixes_match_on_their_bits_only() {
        let c = config([198, 18, 0, 0], 15);
        assert!(c.wants(&event(4, [198, 18, 9, 9])));
        assert!(c.wants(&event(4, [198, 19, 255, 1])));
        assert!(!c.wants(&event(4, [198, 20, 0, 0])));
        assert!(!c.wants(&event(6, [198, 18, 9, 9])), "another family");
        let host = config([198, 18, 0, 1], 32);
        assert!(host.wants(&event(4, [198, 18, 0, 1])));
        assert!(!host.wants(&event(4, [198, 18, 0, 2])));
        assert!(config([10, 0, 0, 0], 0).wants(&event(4, [198, 18, 0, 2])));
    }

    #[test]
    fn rule_verdict_and_interface_filter() {
        let mut c = config([0; 4], 0);
        c.family = 0;
        assert!(
            c.wants(&event(0, [0; 4])),
            "malformed frames have no source"
        );
        c.rule = 4;
        assert!(!c.wants(&event(4, [1, 2, 3, 4])));
        c.rule = 3;
        c.verdicts = 1 << verdict::PASSED;
        assert!(!c.wants(&event(4, [1, 2, 3, 4])));
        c.verdicts |= 1 << verdict::DROPPED;
        assert!(c.wants(&event(4, [1, 2, 3, 4])));
        c.ifindex = 8;
        assert!(!c.wants(&event(4, [1, 2, 3, 4])));
    }

    #[test]
    fn sampling_keeps_one_in_n() {
        let c = TraceConfig {
            sample: 10,
            ..TraceConfig::default()
        };
        assert_eq!((0..1000).filter(|&r| c.sampled(r)).count(), 100);
        assert!((0..5).all(|r| TraceConfig::default().sampled(r)));
    }
}
