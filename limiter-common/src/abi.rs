//! The maps shared by the XDP program and userspace, and the layout of
//! their keys and values. Every type is `#[repr(C)]` with explicit padding
//! fields, so both sides agree byte for byte; each has a size assertion.

use crate::{gcra::Gcra, window::Window};

/// Map names, as the loader and `limiter stats` find them in the object
/// and under the pin directory.
pub mod map_name {
    pub const CONFIG: &str = "CONFIG";
    pub const RULES: &str = "RULES";
    pub const V4_L16: &str = "V4_L16";
    pub const V4_L24: &str = "V4_L24";
    pub const V4_L32: &str = "V4_L32";
    pub const V4_LISTS: &str = "V4_LISTS";
    pub const LPM_V6: &str = "LPM_V6";
    pub const KEYS: &str = "KEYS";
    pub const KEY_TAGS: &str = "KEY_TAGS";
    pub const KEY_FILTER: &str = "KEY_FILTER";
    pub const AGGREGATES: &str = "AGGREGATES";
    pub const BLOCKS_V4: &str = "BLOCKS_V4";
    pub const BLOCKED_V4: &str = "BLOCKED_V4";
    pub const BLOCKS_V6: &str = "BLOCKS_V6";
    pub const IFACES: &str = "IFACES";
    pub const IFACE_MTU: &str = "IFACE_MTU";
    pub const RULE_STATS: &str = "RULE_STATS";
    pub const GLOBAL_STATS: &str = "GLOBAL_STATS";
    pub const ADMISSIONS: &str = "ADMISSIONS";
    pub const FRAGMENTS: &str = "FRAGMENTS";
    pub const SOFT_LIMITS: &str = "SOFT_LIMITS";
    pub const SOFT_STATS: &str = "SOFT_STATS";
    pub const COSTS: &str = "COSTS";
    pub const TRACE: &str = "TRACE";
    pub const TRACE_EVENTS: &str = "TRACE_EVENTS";
    pub const TRACE_COUNTS: &str = "TRACE_COUNTS";
    pub const TRACE_PROG: &str = "TRACE_PROG";
    pub const STAGES: &str = "STAGES";
    pub const HANDOFF: &str = "HANDOFF";
    pub const REPORT_PROG: &str = "REPORT_PROG";
    pub const PENDING_DROPS: &str = "PENDING_DROPS";
    pub const ORPHAN_FRAGMENTS: &str = "ORPHAN_FRAGMENTS";
}

/// Rule ids, including id 0, the default for traffic that matches no rule.
pub const MAX_RULES: u32 = 1024;
/// Rule tables exist twice, one per generation: userspace fills the
/// inactive one, then flips `GlobalConfig::generation`, so every packet is
/// judged entirely by the old rules or entirely by the new ones.
pub const GENERATIONS: u32 = 2;
/// Entries of each LPM trie: both generations' prefixes.
pub const MAX_PREFIXES: u32 = GENERATIONS * (MAX_RULES + 2);

/// The IPv4 rule table: direct-indexed arrays in three strides (16, 8, 8
/// bits of the source), so a source's candidate rules cost at most three
/// inlined array loads, where an LPM trie walks a node per bit of prefix.
/// Every map holds blocks of 256 `u32` entries ([`v4_table::Block`]).
/// Per generation, `V4_L16` holds 256 blocks, one per first octet, with an
/// entry per /16. An entry with [`v4_table::NEXT`] names a block of
/// `V4_L24` (one entry per /24), whose entries may in turn name one of
/// `V4_L32` (one per address). Any other entry is an index in `V4_LISTS`.
/// Indices are absolute (the generation's base included); `V4_LISTS[0]`
/// is always the empty list.
pub mod v4_table {
    use super::MAX_RULES;

    /// Entries of a block: one per value of an octet.
    pub const BLOCK: usize = 256;
    pub type Block = [u32; BLOCK];
    /// `V4_L16` blocks per generation: one per first octet.
    pub const L16_BLOCKS: u32 = 256;
    /// `V4_L24` and `V4_L32` blocks per generation: a prefix needs at most
    /// one at each level.
    pub const SUBTABLES: u32 = MAX_RULES + 2;
    /// Candidate lists per generation: the empty one, and one per prefix.
    pub const LISTS: u32 = MAX_RULES + 3;
    /// Set in an entry that names a block of the next level.
    pub const NEXT: u32 = 1 << 31;
}

/// Interfaces counted apart; slot 0 counts every interface not registered
/// in `IFACES` (and BPF_PROG_TEST_RUN).
pub const MAX_IFACES: u32 = 16;
/// `IFACES` is an array indexed by interface index (one inlined load per
/// packet, where a hash map costs a hash); interfaces with a larger index
/// are counted in slot 0.
pub const MAX_IFINDEX: u32 = 4096;
/// Manual blocks per address family.
pub const MAX_BLOCKS: u32 = 65_536;
/// The slot of the default rule.
pub const DEFAULT_RULE: u32 = 0;
/// How many rules may cover one source prefix (see [`Candidates`]).
pub const MAX_CANDIDATES: usize = 8;
/// Datagrams whose first fragment `FRAGMENTS` remembers (an LRU).
pub const MAX_FRAGMENTED_DATAGRAMS: u32 = 8192;

/// A fragmented datagram: its source (a whole-address [`FlowKey`] of rule
/// 0, so an IPv4 source and its mapped IPv6 address stay apart) and the
/// rest of what the receiver reassembles by (destination, identification,
/// and for IPv4 the protocol), packed in `datagram` (IPv4 exactly; IPv6
/// with its destination folded).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FragmentKey {
    pub source: FlowKey,
    /// Explicit, so the hashed key has no uninitialised bytes.
    pub _pad: u32,
    pub datagram: u64,
}

/// What became of a datagram's first fragment: its later fragments follow.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FirstFragment {
    pub rule: u32,
    /// The generation whose rule it was (another generation's is ignored).
    pub generation: u32,
    /// 1 if it was dropped.
    pub dropped: u32,
    pub _pad: u32,
}

/// A packet as the entry program (`limiter`) parsed it, handed to the
/// decision program (`limiter_decide`) in a per-CPU map
/// (`map_name::HANDOFF`) before a tail call (`map_name::STAGES`), and
/// read by the trace program after either. Two programs, so the verifier
/// checks the matching and the decision once, not once per way a frame
/// can be parsed. Both maps are pinned: while an upgrade swaps the
/// programs, the previous build's entry program may hand over to this
/// build's decision program, so this layout is an ABI (a change needs new
/// map names).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Handoff {
    /// The source address; an IPv4 one in the first four bytes.
    pub addr: [u8; 16],
    /// A fragment's datagram (the parser's `Packet::datagram`).
    pub datagram: u64,
    /// The frame's length in bytes.
    pub len: u32,
    /// The rule generation the packet is judged by, read once.
    pub generation: u32,
    /// The interface's counter slot (`IFACES`).
    pub iface: u32,
    /// The rule the decision program applied (for the trace program).
    pub rule: u32,
    pub dest_port: u32,
    pub protocol: u8,
    pub tcp_flags: u8,
    /// `handoff_flag` bits.
    pub flags: u16,
}

// The layout both builds of an upgrade read: field by field.
const _: () = {
    use core::mem::{offset_of, size_of};
    assert!(size_of::<Handoff>() == 48);
    assert!(offset_of!(Handoff, addr) == 0 && offset_of!(Handoff, datagram) == 16);
    assert!(offset_of!(Handoff, len) == 24 && offset_of!(Handoff, generation) == 28);
    assert!(offset_of!(Handoff, iface) == 32 && offset_of!(Handoff, rule) == 36);
    assert!(offset_of!(Handoff, dest_port) == 40 && offset_of!(Handoff, protocol) == 44);
    assert!(offset_of!(Handoff, tcp_flags) == 45 && offset_of!(Handoff, flags) == 46);
};

/// `Handoff::flags`.
pub mod handoff_flag {
    /// An IP packet: the source and the fields after it are its own (a
    /// malformed frame hands over nothing but its verdict).
    pub const IP: u16 = 1;
    /// The source is IPv6.
    pub const V6: u16 = 2;
    /// A first fragment, whose verdict its datagram's later ones follow.
    pub const FIRST_FRAGMENT: u16 = 4;
    /// A fragment past the first: no transport header of its own.
    pub const LATER_FRAGMENT: u16 = 8;
    /// Its port is not known (a later fragment, an unreadable transport
    /// header): it may belong to any rule of its protocol.
    pub const PORT_UNKNOWN: u16 = 16;
    /// RFC 1858's tiny first fragment: dropped, under the rule it may
    /// belong to (so a trace shows that rule).
    pub const TINY_FRAGMENT: u16 = 32;
}

/// `BLOCKED_V4`: one bit per IPv4 /16, set while a block covers any of
/// it, so a source with no block near it skips the blocks trie.
pub const BLOCKED_V4_WORDS: u32 = (1 << 16) / 64;

/// Default capacity of the key table.
pub const DEFAULT_MAX_KEYS: u32 = 1 << 20;
/// The largest key table (its slot count must fit a `u32` index).
pub const MAX_KEYS: u32 = 1 << 30;
/// The longest IPv6 extension-header chain the parser walks.
pub const MAX_IPV6_EXT_HEADERS: usize = 6;
/// Longest rule name stored in the kernel (NUL-padded).
pub const RULE_NAME_LEN: usize = 32;

/// What to do with a packet: the XDP verdicts the program uses.
pub mod action {
    pub const PASS: u32 = 0;
    pub const DROP: u32 = 1;
}

/// Settings that apply to every packet. One entry, index 0.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GlobalConfig {
    /// [`action`] for frames the parser rejects (truncated or malformed).
    pub malformed_action: u32,
    /// The active generation of the rule tables (0 or 1).
    pub generation: u32,
    /// [`global_flag`] bits.
    pub flags: u32,
    /// Where userspace continues allocating rule ids (kept here so that it
    /// survives restarts along with the tables).
    pub next_rule_id: u32,
    /// `CLOCK_REALTIME − CLOCK_MONOTONIC`, refreshed by userspace: window
    /// algorithms align their windows to the Unix epoch.
    pub realtime_offset_ns: u64,
    /// How many blocks the tries hold: 0 skips the lookup.
    pub blocks: u32,
    /// Moves on every change to the blocks. A key remembers the epoch at
    /// which its source was last found unblocked (`keytable::Slot::block_epoch`),
    /// so a tracked source costs no trie lookup until the blocks change.
    pub block_epoch: u32,
    /// Buckets of the key table (`KEYS`, a power of two), set at load.
    pub key_buckets: u32,
    /// Which half (0 or 1) of the key table's presence filter lookups read
    /// (`keytable::filter_words`); the other is the one being rebuilt.
    pub key_filter: u32,
    /// The key table's hash seed ([`crate::keytable::hash`]): random, set
    /// when the table is created, kept with it.
    pub key_seed: u64,
}

/// `GlobalConfig::flags` bits.
pub mod global_flag {
    /// Dry run for everything: every drop is counted as shadow and passed.
    pub const SHADOW: u32 = 1 << 0;
    /// Later fragments whose first fragment was not seen are dropped (the
    /// rule file's `fragments: drop`), not charged to the strictest rule
    /// they may belong to.
    pub const DROP_ORPHAN_FRAGMENTS: u32 = 1 << 1;
}

/// Indices of `ORPHAN_FRAGMENTS`, a per-CPU count of later fragments whose
/// first fragment was not seen: charged to the strictest rule they may
/// belong to, or dropped.
pub mod orphan_fragments {
    pub const CHARGED: u32 = 0;
    pub const DROPPED: u32 = 1;
    pub const ENTRIES: u32 = 2;
}

/// The index in `RULE_STATS` of rule `id`'s counters on interface slot `iface`.
#[inline(always)]
pub fn counter_slot(iface: u32, id: u32) -> u32 {
    iface * MAX_RULES + id
}

/// The index in `RULES` of rule `id` in `generation`.
#[inline(always)]
pub fn rule_slot(generation: u32, id: u32) -> u32 {
    (generation & 1) * MAX_RULES + id
}

/// `RuleConfig::flags` bits.
pub mod rule_flag {
    /// Every packet passes (an allow list); nothing is metered.
    pub const UNLIMITED: u32 = 1 << 0;
    /// Excess is counted but passed (dry run).
    pub const SHADOW: u32 = 1 << 1;
    /// `RuleConfig::packets` is in force.
    pub const LIMIT_PACKETS: u32 = 1 << 2;
    /// `RuleConfig::bytes` is in force.
    pub const LIMIT_BYTES: u32 = 1 << 3;
    /// Every packet is dropped (the default rule with `default: drop`).
    pub const BLOCK: u32 = 1 << 4;
    /// `RuleConfig::aggregate_packets` is in force (one budget for the rule).
    pub const AGGREGATE_PACKETS: u32 = 1 << 5;
    /// `RuleConfig::aggregate_bytes` is in force.
    pub const AGGREGATE_BYTES: u32 = 1 << 6;
    /// A soft packet limit is in force (`SOFT_LIMITS` at the rule's slot;
    /// GCRA rules only): a packet the key's soft meter refuses is passed
    /// all the same, and counted as over it (`SOFT_STATS`).
    pub const SOFT: u32 = 1 << 7;
    /// Packets cost credits by class (`COSTS` at the rule's slot): the
    /// packet meters (the key's and the aggregate's) charge them instead
    /// of 1.
    pub const COSTS: u32 = 1 << 8;
    /// `RuleConfig::bytes` is a second packet limit (`limits: [...]`):
    /// the key's byte meter charges a packet's credits, not its length.
    pub const BYTES_COUNT_PACKETS: u32 = 1 << 9;
    /// A third limit per key (`limits: [...]` with three; GCRA rules
    /// only, never with `SOFT`): its meter is the key state's third word,
    /// its parameters at the rule's slot of `SOFT_LIMITS`, which holds the
    /// Gcra of that word whatever it limits.
    pub const THIRD_LIMIT: u32 = 1 << 10;
    /// The third limit counts bytes (a frame's length), not credits.
    pub const THIRD_COUNTS_BYTES: u32 = 1 << 11;
}

/// Classes of a rule's `cost`, at most.
pub const MAX_COST_CLASSES: usize = 4;

/// One class of packets and what each costs: TCP segments whose flags,
/// masked, have this value.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CostClass {
    pub credits: u32,
    pub tcp_flags_mask: u8,
    pub tcp_flags_value: u8,
    pub _pad: [u8; 2],
}

/// A rule's packet costs (`COSTS`, by `rule_slot`): the first class a
/// packet is in says what it costs; 1 when it is in none.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Costs {
    pub classes: [CostClass; MAX_COST_CLASSES],
    pub len: u32,
    pub _pad: u32,
}

const _: () = assert!(core::mem::size_of::<Costs>() == 40);

impl Costs {
    /// What a packet of this protocol, destination port and TCP flags
    /// costs (flags are known only with the port: [`Candidate::matches`]).
    #[inline(always)]
    pub fn credits(&self, protocol: u8, dest_port: u32, tcp_flags: u8) -> u64 {
        if protocol != 6 || dest_port == NO_PORT {
            return 1;
        }
        let mut i = 0;
        while i < MAX_COST_CLASSES {
            if i as u32 >= self.len {
                break;
            }
            let class = &self.classes[i];
            if tcp_flags & class.tcp_flags_mask == class.tcp_flags_value {
                return u64::from(class.credits);
            }
            i += 1;
        }
        1
    }
}

/// `RuleConfig::algorithm` values.
pub mod algorithm {
    pub const GCRA: u32 = 0;
    pub const FIXED_WINDOW: u32 = 1;
    pub const SLIDING_WINDOW: u32 = 2;
}

/// One meter's parameters: `gcra` for GCRA rules, `window` for the others.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MeterConfig {
    pub gcra: Gcra,
    pub window: Window,
}

/// One rule, as the kernel applies it. Array map indexed by [`rule_slot`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RuleConfig {
    /// [`rule_flag`] bits.
    pub flags: u32,
    /// Mask applied to an IPv4 source to form its key (network byte order).
    pub v4_key_mask: [u8; 4],
    /// Mask applied to an IPv6 source to form its key (network byte order).
    pub v6_key_mask: [u8; 16],
    /// [`algorithm`] of every meter of the rule.
    pub algorithm: u32,
    /// Identifies the rule's keys (algorithm, match and key, not limits):
    /// a reload keeps the id and the keys, their state carried over to the
    /// new limits, of a rule whose limits alone changed. 0: written by a
    /// build that kept none.
    pub identity: u32,
    /// Meter for packets (cost 1 per packet).
    pub packets: MeterConfig,
    /// Meter for bytes (cost = frame length, Ethernet header included).
    pub bytes: MeterConfig,
    /// Meters shared by every key of the rule (hierarchical limits).
    pub aggregate_packets: MeterConfig,
    /// A fleet rule's reserve: in force once `fleet_until_ns` has passed.
    /// Right after `aggregate_packets`, so choosing one is an offset.
    pub fleet_reserve: MeterConfig,
    pub aggregate_bytes: MeterConfig,
    /// A fleet-wide aggregate (`scope: fleet`): `aggregate_packets` is this
    /// node's leased share, in force until this monotonic time; after it,
    /// the node's reserve (`fleet_reserve`). So a share whose leases were
    /// not renewed in time (the daemon died, the store is gone) lapses in
    /// the kernel itself, before another node can lease it. 0: not a fleet
    /// rule.
    pub fleet_until_ns: u64,
    /// The budget of key creations (`new_keys` in the rule file): a source
    /// not yet tracked gets a key only while it lasts; beyond it, its
    /// packets are dropped and counted as `unadmitted`, so a flood of
    /// forged sources can neither churn out the keys of real ones nor
    /// spend a fresh burst per forged address.
    pub admission: Gcra,
    /// Identifies the rule's match, key and limits: a reload keeps the id,
    /// and so the buckets, of a rule whose fingerprint did not change.
    pub fingerprint: u64,
    /// The rule's name, NUL-padded, so pinned maps describe themselves.
    pub name: [u8; RULE_NAME_LEN],
}

impl RuleConfig {
    /// The aggregate's packet meter in force at `now` (monotonic): the
    /// leased share of a fleet rule until it lapses, then its reserve.
    ///
    /// Without a branch: the verifier would explore everything after it
    /// twice (the program then no longer loads). Both times are below
    /// 2^63 ns, so a sign bit says which is larger.
    #[inline(always)]
    pub fn aggregate_packets_at(&self, now: u64) -> &MeterConfig {
        let until = self.fleet_until_ns;
        let fleet = (until | until.wrapping_neg()) >> 63;
        let lapsed = (until.wrapping_sub(now).wrapping_sub(1) >> 63) & fleet;
        let meters: *const MeterConfig = &raw const self.aggregate_packets;
        // SAFETY: `fleet_reserve` follows `aggregate_packets` (asserted
        // below), and `lapsed` is 0 or 1: both are fields of `self`.
        unsafe { &*meters.add(lapsed as usize) }
    }

    /// The name, without its NUL padding.
    pub fn name(&self) -> &[u8] {
        let len = self
            .name
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(self.name.len());
        &self.name[..len]
    }
}

/// `Candidate::flags` bits.
pub mod candidate_flag {
    pub const MATCH_PROTOCOL: u8 = 1 << 0;
    pub const MATCH_DEST_PORT: u8 = 1 << 1;
    /// The rule is `limit: unlimited` (an exemption).
    pub const UNLIMITED: u8 = 1 << 2;
    /// The rule names TCP flags (`Candidate::tcp_flags_mask`/`_value`).
    pub const MATCH_TCP_FLAGS: u8 = 1 << 3;
}

/// A rule that may apply to packets from a source prefix, with the
/// protocol and destination port that narrow it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Candidate {
    pub rule: u16,
    /// Destination port in host byte order.
    pub dest_port: u16,
    /// IP protocol number (6 TCP, 17 UDP, 1 ICMP, 58 ICMPv6).
    pub protocol: u8,
    /// [`candidate_flag`] bits.
    pub flags: u8,
    /// With `MATCH_TCP_FLAGS`: the TCP flags byte of a segment, masked by
    /// `tcp_flags_mask`, must equal `tcp_flags_value` (`syn,!ack`: mask
    /// SYN|ACK, value SYN). Padding in builds before it: zero, unused.
    pub tcp_flags_mask: u8,
    pub tcp_flags_value: u8,
}

impl Candidate {
    /// Whether this candidate applies to a packet with this protocol,
    /// destination port ([`NO_PORT`] when the packet has none, e.g. a
    /// later fragment) and TCP flags (0 for anything but a TCP segment).
    #[inline(always)]
    pub fn matches(&self, protocol: u8, dest_port: u32, tcp_flags: u8) -> bool {
        if self.flags & candidate_flag::MATCH_PROTOCOL != 0 && self.protocol != protocol {
            return false;
        }
        // Flags are known only of a segment whose header was read, which
        // is when its port is: `!ack` says nothing of an unread header.
        if self.flags & candidate_flag::MATCH_TCP_FLAGS != 0
            && (dest_port == NO_PORT || tcp_flags & self.tcp_flags_mask != self.tcp_flags_value)
        {
            return false;
        }
        if self.flags & candidate_flag::MATCH_DEST_PORT != 0 {
            return dest_port == u32::from(self.dest_port);
        }
        true
    }

    /// Whether this candidate may apply to a packet whose port is unknown
    /// (a later fragment, an unreadable transport header): any port, and
    /// any protocol if `protocol` is [`UNKNOWN_PROTOCOL`]. Such a packet is
    /// charged to the first candidate it could belong to, but never
    /// exempted on a guess: an unlimited candidate applies only when what
    /// it names (protocol, port) is known to match.
    #[inline(always)]
    pub fn may_match_unknown_port(&self, protocol: u8) -> bool {
        // A segment whose header cannot be read shows no flags either.
        if self.flags & candidate_flag::MATCH_TCP_FLAGS != 0 {
            return false;
        }
        let names_protocol = self.flags & candidate_flag::MATCH_PROTOCOL != 0;
        let names_port = self.flags & candidate_flag::MATCH_DEST_PORT != 0;
        let exempts = self.flags & candidate_flag::UNLIMITED != 0;
        if exempts && (names_port || (names_protocol && protocol == UNKNOWN_PROTOCOL)) {
            return false;
        }
        !names_protocol || protocol == UNKNOWN_PROTOCOL || self.protocol == protocol
    }
}

/// `Packet::protocol` when the transport protocol is unknown: behind more
/// IPv6 extension headers than the parser walks (255 is reserved by IANA).
pub const UNKNOWN_PROTOCOL: u8 = 255;

/// A packet without a destination port. A sentinel rather than `Option<u16>`:
/// LLVM may leave the payload of a `None` undefined and still compare it,
/// and the verifier rejects the stale pointer it can find there.
pub const NO_PORT: u32 = u32::MAX;

/// The value of an LPM trie entry: every rule whose source prefix covers
/// this entry's prefix, most specific first (longer prefix, then protocol
/// and port, then protocol only, then neither). The first that matches the
/// packet's protocol and port applies.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Candidates {
    pub len: u32,
    /// The rule a packet whose port is unknown (a later fragment whose
    /// first was not seen, an unreadable transport header) is charged to,
    /// per [`unknown_port::class`] of its protocol: the strictest rule it
    /// may belong to, chosen by userspace. [`unknown_port::NOT_CHOSEN`]
    /// (pins of a build before it, or a protocol without ports) leaves the
    /// choice to the first candidate it may belong to; else an index into
    /// `entries` plus one, or [`unknown_port::DEFAULT`].
    pub unknown_port: [u8; 4],
    pub entries: [Candidate; MAX_CANDIDATES],
}

impl Candidates {
    /// The rule a packet of `protocol` whose port is unknown is charged
    /// to, when userspace chose one (see `unknown_port`).
    #[inline(always)]
    pub fn unknown_port_rule(&self, protocol: u8) -> Option<u32> {
        let choice = *self.unknown_port.get(unknown_port::class(protocol)?)?;
        if choice == unknown_port::DEFAULT {
            return Some(DEFAULT_RULE);
        }
        let index = usize::from(choice).checked_sub(1)?;
        if index as u32 >= self.len {
            return None;
        }
        self.entries.get(index).map(|c| u32::from(c.rule))
    }
}

/// `Candidates::unknown_port`: which rule a packet whose port is unknown
/// is charged to, by the class of its protocol. Only the protocols with
/// ports (TCP, UDP, SCTP) and an unknown one have a choice to make: a rule
/// of any other protocol names no port, so the first candidate it may
/// belong to is its rule, port or not.
pub mod unknown_port {
    pub const TCP: usize = 0;
    pub const UDP: usize = 1;
    pub const SCTP: usize = 2;
    /// Behind more IPv6 extension headers than the parser walks.
    pub const UNKNOWN: usize = 3;
    /// No choice made: the first candidate the packet may belong to.
    pub const NOT_CHOSEN: u8 = 0;
    /// The default rule (no candidate may be the packet's for sure).
    pub const DEFAULT: u8 = 0xff;
    /// (class, protocol number) of each class.
    pub const CLASSES: [(usize, u8); 4] = [
        (TCP, 6),
        (UDP, 17),
        (SCTP, 132),
        (UNKNOWN, super::UNKNOWN_PROTOCOL),
    ];

    /// The class of a protocol, if it has one.
    #[inline(always)]
    pub fn class(protocol: u8) -> Option<usize> {
        match protocol {
            6 => Some(TCP),
            17 => Some(UDP),
            132 => Some(SCTP),
            super::UNKNOWN_PROTOCOL => Some(UNKNOWN),
            _ => None,
        }
    }
}

/// Key of an LPM trie: the generation, then the source address, so both
/// generations live side by side in one trie.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefixKey<const N: usize> {
    pub generation: u8,
    pub addr: [u8; N],
}

/// A manual block (`limiter block`). The kernel stops applying it at
/// `expires_ns` by itself.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Block {
    /// `CLOCK_MONOTONIC` ns after which the block no longer applies; 0: never.
    pub expires_ns: u64,
    /// Packets it dropped (atomic adds from every CPU).
    pub dropped_packets: u64,
}

/// Key of the key table (`keytable`): a rule and a masked source address
/// (IPv4 as `::ffff:a.b.c.d`, with [`FlowKey::V4`] set in `rule`), so one
/// source has separate budgets per rule.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FlowKey {
    pub rule: u32,
    pub addr: [u8; 16],
}

impl FlowKey {
    /// Set in `rule` for an IPv4 source: an IPv6 packet from the mapped
    /// address `::ffff:a.b.c.d` has the same `addr`, and must not share
    /// (or spend) the IPv4 source's budget.
    pub const V4: u32 = 1 << 31;

    /// The key of an IPv4 source under a rule's mask.
    #[inline(always)]
    pub fn v4(rule: u32, src: [u8; 4], mask: [u8; 4]) -> Self {
        // Built as words: byte by byte, the BPF target zeroes the address
        // with a call to `memset` and writes each byte apart.
        let mapped = u32::from_ne_bytes([0, 0, 0xff, 0xff]);
        let source = u32::from_ne_bytes(src) & u32::from_ne_bytes(mask);
        Self {
            rule: rule | Self::V4,
            addr: words_to_addr([0, 0, mapped, source]),
        }
    }

    /// The id of the rule the key belongs to.
    #[inline(always)]
    pub fn rule_id(&self) -> u32 {
        self.rule & !Self::V4
    }

    /// Whether the key is an IPv4 source's.
    #[inline(always)]
    pub fn is_v4(&self) -> bool {
        self.rule & Self::V4 != 0
    }

    /// The key of an IPv6 source under a rule's mask.
    #[inline(always)]
    pub fn v6(rule: u32, src: [u8; 16], mask: [u8; 16]) -> Self {
        let (src, mask) = (addr_to_words(src), addr_to_words(mask));
        Self {
            rule,
            addr: words_to_addr([
                src[0] & mask[0],
                src[1] & mask[1],
                src[2] & mask[2],
                src[3] & mask[3],
            ]),
        }
    }
}

/// An address as four native-endian words, and back (see [`FlowKey::v4`]).
#[inline(always)]
fn addr_to_words(addr: [u8; 16]) -> [u32; 4] {
    // SAFETY: both are 16 bytes of plain data.
    unsafe { core::mem::transmute(addr) }
}

#[inline(always)]
fn words_to_addr(words: [u32; 4]) -> [u8; 16] {
    // SAFETY: both are 16 bytes of plain data.
    unsafe { core::mem::transmute(words) }
}

/// A rule's aggregate state in `AGGREGATES`: its packet meter (index 0)
/// and its byte meter (1).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AggregateState {
    /// GCRA: `[TAT, -, -]` in ns of `CLOCK_MONOTONIC`, updated lock-free
    /// with compare-and-swap. Windows: `[start, previous, current]`
    /// ([`crate::window::WindowState`]), changed together under `lock`.
    pub meters: [[u64; 3]; 2],
    /// Window algorithms only: 0 free, 1 held (taken with compare-and-swap).
    pub lock: u32,
    pub _reserved: u32,
}

/// A tracked key's state, 32 bytes (a [`crate::keytable::Slot`] holds it
/// beside its key): every algorithm's in three words.
///
/// GCRA: `meters = [packets TAT, bytes TAT, 0]`, ns of `CLOCK_MONOTONIC`,
/// updated lock-free with compare-and-swap.
///
/// Windows: `meters = [start, packets, bytes]`: the start of the current
/// window (epoch ns; one per key, as a rule has one unit for both meters),
/// then each meter's counts packed as `previous << 32 | current`
/// ([`crate::keytable::window_state`]). Bit 31 of the packets word is the
/// lock under which all three change together
/// ([`crate::keytable::WINDOW_LOCK`]): a key's counts stay below 2^31,
/// which rule validation guarantees ([`crate::keytable::MAX_WINDOW_LIMIT`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeyState {
    pub meters: [u64; 3],
    /// What the key passed and dropped, for `limiter top`: plain wrapping
    /// adds (two CPUs counting the same key at once may lose an increment;
    /// `top` reads differences), the exact totals are the per-CPU rule
    /// counters.
    pub passed_packets: u32,
    pub dropped_packets: u32,
}

/// A CPU's refusals of one key not yet added to the key's
/// [`KeyState::dropped_packets`] (the `PENDING_DROPS` map, one per CPU).
/// A flood from one source spread over CPUs would otherwise write its
/// key's slot with every refused frame, and the slot's cache line, which
/// every CPU reads for the key's meters, would move between them with
/// each: the entry keeps the key this CPU refuses most, counted here,
/// and other keys' refusals go to their slots as before. When another key
/// takes the entry, the former one's count waits in `old_*` until the
/// report program, reached by a tail call after the decision, adds it to
/// that key's slot (the lookup of a slot by key is verified there, once,
/// not on the decision's every path). Readers of the key table add
/// `count` and `old_count` to their keys'; `flushes`, odd while the entry
/// changes hands or a count moves to a slot, tells them to read again.
/// Counts held for a key whose slot was taken by another stay the key's:
/// if it is tracked again, they are added to its new slot.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PendingDrops {
    pub key: FlowKey,
    /// Refusals of `key` held here (0: the entry holds no key).
    pub count: u32,
    /// Refusals of other keys since `key`'s last one: once it reaches
    /// `PendingDrops::TAKE_OVER_AFTER`, the next key refused (other than
    /// `key`) takes the entry.
    pub others: u32,
    /// Twice the number of changes of hands and moves to slots, plus one
    /// during one.
    pub flushes: u32,
    /// The key that held the entry before, and its refusals not yet on its
    /// slot (0: none).
    pub old_key: FlowKey,
    pub old_count: u32,
}

impl PendingDrops {
    /// Refusals of other keys after which a key no longer holds the
    /// entry: a key refused again before so many keeps it.
    pub const TAKE_OVER_AFTER: u32 = 64;
}

/// Per-rule counters, one per CPU: each CPU only writes its own copy, so
/// plain increments are exact without atomics; readers sum the CPUs.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(serde::Serialize, serde::Deserialize))]
pub struct RuleCounters {
    pub passed_packets: u64,
    pub passed_bytes: u64,
    pub dropped_packets: u64,
    pub dropped_bytes: u64,
    /// Excess under `shadow`: would have been dropped, was passed.
    pub shadow_packets: u64,
    pub shadow_bytes: u64,
    /// Keys this rule added to the state map.
    pub new_keys: u64,
    /// Packets treated as excess because every compare-and-swap lost.
    pub contended: u64,
    /// Of `dropped_packets`/`shadow_packets`: those the rule's aggregate
    /// limit refused although their key's own budget allowed them.
    pub aggregate_excess: u64,
    /// Of `dropped_packets`/`shadow_packets`: packets of sources not yet
    /// tracked that arrived when the rule's key-creation budget was spent.
    pub unadmitted: u64,
}

/// Counters for every packet, one per CPU.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(serde::Serialize, serde::Deserialize))]
pub struct GlobalCounters {
    pub packets: u64,
    pub ipv4: u64,
    pub ipv6: u64,
    /// Not IP (ARP, LLDP, ...): always passed.
    pub non_ip: u64,
    /// Rejected by the parser: truncated or malformed headers.
    pub malformed: u64,
    /// Non-first IP fragments (no transport header to match ports on).
    pub fragments: u64,
    /// New keys refused because their bucket had no free slot and none at
    /// rest (see `keytable`): the packet is dropped.
    pub key_alloc_failed: u64,
    /// Dropped (or shadow-passed) by a manual block.
    pub blocked: u64,
    /// Keys at rest whose slot went to a new key (see `keytable`).
    pub key_evictions: u64,
    /// Packets whose transport header could not be read (cut short, or
    /// behind too many IPv6 extension headers): charged as if any port.
    pub unreadable_transport: u64,
    /// First fragments too short for their transport header: dropped.
    pub tiny_fragments: u64,
}

macro_rules! impl_rule_counters_add {
    ($($t:ident { $($f:ident),* })*) => {$(
        impl $t {
            /// Field-wise sum, for adding up the per-CPU copies.
            pub fn add(&mut self, other: &Self) {
                $(self.$f = self.$f.wrapping_add(other.$f);)*
            }
        }
    )*};
}

impl_rule_counters_add! {
    RuleCounters { passed_packets, passed_bytes, dropped_packets, dropped_bytes,
                   shadow_packets, shadow_bytes, new_keys, contended, aggregate_excess,
                   unadmitted }
    GlobalCounters { packets, ipv4, ipv6, non_ip, malformed, fragments, key_alloc_failed, blocked,
                     key_evictions, unreadable_transport, tiny_fragments }
}

const _: () = {
    assert!(core::mem::size_of::<GlobalConfig>() == 48);
    assert!(core::mem::size_of::<MeterConfig>() == 48);
    assert!(
        core::mem::offset_of!(RuleConfig, fleet_reserve)
            == core::mem::offset_of!(RuleConfig, aggregate_packets) + 48
    );
    assert!(
        core::mem::size_of::<RuleConfig>()
            == 4 + 4 + 16 + 8 + 4 * 48 + 8 + 48 + 24 + 8 + RULE_NAME_LEN
    );
    assert!(core::mem::size_of::<PrefixKey<4>>() == 5);
    assert!(core::mem::size_of::<PrefixKey<16>>() == 17);
    assert!(core::mem::size_of::<Block>() == 16);
    assert!(core::mem::size_of::<Candidate>() == 8);
    assert!(core::mem::size_of::<Candidates>() == 8 + 8 * MAX_CANDIDATES);
    assert!(core::mem::size_of::<FlowKey>() == 20);
    assert!(core::mem::size_of::<FragmentKey>() == 32);
    assert!(core::mem::size_of::<KeyState>() == 32);
    assert!(core::mem::size_of::<PendingDrops>() == 56);
    assert!(core::mem::size_of::<AggregateState>() == 56);
    assert!(core::mem::size_of::<RuleCounters>() == 80);
    assert!(core::mem::size_of::<GlobalCounters>() == 88);
};

#[cfg(feature = "user")]
mod pod {
    // SAFETY: all are repr(C), Copy, with explicit padding fields, so every
    // bit pattern is valid and none has uninitialised bytes.
    unsafe impl aya::Pod for super::GlobalConfig {}
    unsafe impl aya::Pod for super::RuleConfig {}
    unsafe impl aya::Pod for super::Candidates {}
    unsafe impl aya::Pod for super::PrefixKey<4> {}
    unsafe impl aya::Pod for super::PrefixKey<16> {}
    unsafe impl aya::Pod for super::Block {}
    unsafe impl aya::Pod for super::FlowKey {}
    unsafe impl aya::Pod for super::KeyState {}
    unsafe impl aya::Pod for super::PendingDrops {}
    unsafe impl aya::Pod for super::AggregateState {}
    unsafe impl aya::Pod for super::RuleCounters {}
    unsafe impl aya::Pod for super::GlobalCounters {}
    unsafe impl aya::Pod for crate::gcra::Gcra {}
    unsafe impl aya::Pod for super::Costs {}
    unsafe impl aya::Pod for crate::trace::TraceConfig {}
    unsafe impl aya::Pod for crate::trace::TraceEvent {}
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Guards the flag words: each flag one bit of its own (a flag that
    /// became 0, or another's bit, would switch a feature off or on).
    #[test]
    fn every_flag_is_a_bit_of_its_own() {
        let distinct_bits = |flags: &[u32]| {
            flags.iter().all(|f| f.is_power_of_two())
                && flags.iter().fold(0, |all, f| all | f).count_ones() as usize == flags.len()
        };
        assert!(distinct_bits(&[
            rule_flag::UNLIMITED,
            rule_flag::SHADOW,
            rule_flag::LIMIT_PACKETS,
            rule_flag::LIMIT_BYTES,
            rule_flag::BLOCK,
            rule_flag::AGGREGATE_PACKETS,
            rule_flag::AGGREGATE_BYTES,
            rule_flag::SOFT,
            rule_flag::COSTS,
            rule_flag::BYTES_COUNT_PACKETS,
            rule_flag::THIRD_LIMIT,
            rule_flag::THIRD_COUNTS_BYTES,
        ]));
        assert!(distinct_bits(&[
            global_flag::SHADOW,
            global_flag::DROP_ORPHAN_FRAGMENTS
        ]));
        assert!(distinct_bits(&[
            candidate_flag::MATCH_PROTOCOL.into(),
            candidate_flag::MATCH_DEST_PORT.into(),
            candidate_flag::UNLIMITED.into(),
            candidate_flag::MATCH_TCP_FLAGS.into(),
        ]));
    }

    /// A port-less packet's rule, by its protocol's class: the choice
    /// userspace made (an entry, or the default rule), or none.
    #[test]
    fn a_packet_without_a_port_goes_to_the_rule_chosen_for_its_protocol() {
        for (class, protocol) in unknown_port::CLASSES {
            assert_eq!(unknown_port::class(protocol), Some(class));
        }
        assert_eq!(unknown_port::class(1), None, "ICMP has no port to lack");
        let mut candidates = Candidates {
            len: 2,
            ..Candidates::default()
        };
        candidates.entries[0].rule = 7;
        candidates.entries[1].rule = 9;
        candidates.unknown_port[unknown_port::UDP] = 2;
        candidates.unknown_port[unknown_port::TCP] = unknown_port::DEFAULT;
        candidates.unknown_port[unknown_port::SCTP] = 3;
        assert_eq!(candidates.unknown_port_rule(17), Some(9));
        assert_eq!(candidates.unknown_port_rule(6), Some(DEFAULT_RULE));
        assert_eq!(candidates.unknown_port_rule(132), None, "past the entries");
        assert_eq!(
            candidates.unknown_port_rule(UNKNOWN_PROTOCOL),
            None,
            "not chosen"
        );
        assert_eq!(candidates.unknown_port_rule(1), None);
    }

    /// A TCP packet with a port costs its first matching class's credits;
    /// anything else costs 1.
    #[test]
    fn credits_are_the_first_matching_classs() {
        let class = |credits, mask, value| CostClass {
            credits,
            tcp_flags_mask: mask,
            tcp_flags_value: value,
            _pad: [0; 2],
        };
        let (syn, ack) = (0x02, 0x10);
        let mut costs = Costs::default();
        costs.classes[0] = class(10, syn | ack, syn);
        costs.classes[1] = class(3, 0, 0);
        costs.classes[2] = class(99, 0, 0);
        costs.len = 2;
        assert_eq!(costs.credits(6, 443, syn), 10, "a bare SYN");
        assert_eq!(costs.credits(6, 443, syn | ack), 3, "any other segment");
        assert_eq!(costs.credits(17, 443, syn), 1, "not TCP");
        assert_eq!(costs.credits(6, NO_PORT, syn), 1, "no port seen");
        costs.len = 1;
        assert_eq!(costs.credits(6, 443, ack), 1, "no class matches");
    }

    /// Guards the branch-free choice: a fleet share until it lapses, then
    /// the reserve; a local rule's meter always.
    #[test]
    fn a_fleet_share_lapses_to_the_reserve() {
        let mut rule = RuleConfig::default();
        rule.aggregate_packets.gcra.burst = 7;
        rule.fleet_reserve.gcra.burst = 1;
        let burst = |rule: &RuleConfig, now| rule.aggregate_packets_at(now).gcra.burst;
        for now in [0, 1, 5_000, 1 << 62] {
            assert_eq!(burst(&rule, now), 7, "a local rule at {now}");
        }
        rule.fleet_until_ns = 5_000;
        assert_eq!(burst(&rule, 0), 7);
        assert_eq!(burst(&rule, 4_999), 7);
        assert_eq!(burst(&rule, 5_000), 1);
        assert_eq!(burst(&rule, 1 << 62), 1);
        rule.fleet_until_ns = 1;
        assert_eq!(burst(&rule, 0), 7);
        assert_eq!(burst(&rule, 1), 1);
    }

    /// Guards the slot arithmetic: every (generation, id) and every
    /// (interface, id) has its own slot, generations alternate by the low bit.
    #[test]
    fn slots_are_distinct_and_in_range() {
        assert_eq!(rule_slot(0, 5), 5);
        assert_eq!(rule_slot(1, 5), MAX_RULES + 5);
        assert_eq!(rule_slot(2, 5), 5);
        assert_eq!(rule_slot(3, MAX_RULES - 1), 2 * MAX_RULES - 1);
        assert_eq!(counter_slot(0, 7), 7);
        assert_eq!(counter_slot(3, 7), 3 * MAX_RULES + 7);
        assert_eq!(
            counter_slot(MAX_IFACES - 1, MAX_RULES - 1),
            MAX_IFACES * MAX_RULES - 1
        );
    }

    /// Guards the candidate test the kernel runs per packet.
    #[test]
    fn candidates_match_protocol_and_port() {
        let any = Candidate::default();
        assert!(any.matches(17, 53, 0) && any.matches(6, NO_PORT, 0));
        let udp = Candidate {
            protocol: 17,
            flags: candidate_flag::MATCH_PROTOCOL,
            ..Candidate::default()
        };
        assert!(udp.matches(17, 53, 0) && udp.matches(17, NO_PORT, 0));
        assert!(!udp.matches(6, 53, 0));
        let dns = Candidate {
            protocol: 17,
            dest_port: 53,
            flags: candidate_flag::MATCH_PROTOCOL | candidate_flag::MATCH_DEST_PORT,
            ..Candidate::default()
        };
        assert!(dns.matches(17, 53, 0));
        assert!(!dns.matches(17, 54, 0) && !dns.matches(6, 53, 0) && !dns.matches(17, NO_PORT, 0));
        // `syn,!ack`: a SYN, not a SYN-ACK nor any other segment.
        let syn = Candidate {
            protocol: 6,
            flags: candidate_flag::MATCH_PROTOCOL | candidate_flag::MATCH_TCP_FLAGS,
            tcp_flags_mask: 0x12,
            tcp_flags_value: 0x02,
            ..Candidate::default()
        };
        assert!(syn.matches(6, 22, 0x02));
        assert!(
            !syn.matches(6, 22, 0x12) && !syn.matches(6, 22, 0x10) && !syn.matches(17, 22, 0x02)
        );
        assert!(
            !syn.may_match_unknown_port(6),
            "an unreadable header shows no flags"
        );
        let not_ack = Candidate {
            tcp_flags_mask: 0x10,
            tcp_flags_value: 0,
            ..syn
        };
        assert!(not_ack.matches(6, 22, 0x02));
        assert!(
            !not_ack.matches(6, NO_PORT, 0),
            "a later fragment's flags are unknown"
        );
        // A port unknown: any port, any protocol if that is unknown too.
        assert!(dns.may_match_unknown_port(17) && dns.may_match_unknown_port(UNKNOWN_PROTOCOL));
        assert!(!dns.may_match_unknown_port(6));
        // An exemption applies only to what it is known to cover.
        let free = |flags| Candidate {
            protocol: 6,
            dest_port: 443,
            flags: flags | candidate_flag::UNLIMITED,
            ..Candidate::default()
        };
        let https = free(candidate_flag::MATCH_PROTOCOL | candidate_flag::MATCH_DEST_PORT);
        assert!(
            !https.may_match_unknown_port(6) && !https.may_match_unknown_port(UNKNOWN_PROTOCOL)
        );
        let tcp = free(candidate_flag::MATCH_PROTOCOL);
        assert!(tcp.may_match_unknown_port(6) && !tcp.may_match_unknown_port(UNKNOWN_PROTOCOL));
        let office = free(0);
        assert!(office.may_match_unknown_port(UNKNOWN_PROTOCOL));
    }

    /// Guards key masking: the bits outside the mask never reach the key,
    /// and IPv4 keys sit in the IPv4-mapped range.
    #[test]
    fn keys_are_masked_sources() {
        let key = FlowKey::v4(9, [198, 18, 7, 200], [255, 255, 255, 0]);
        assert_eq!(key.rule_id(), 9);
        assert!(key.is_v4());
        assert_eq!(
            key.addr,
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 198, 18, 7, 0]
        );
        let src: [u8; 16] = core::array::from_fn(|i| 0xa0 + i as u8);
        let mask: [u8; 16] = core::array::from_fn(|i| if i < 8 { 0xff } else { 0 });
        let key = FlowKey::v6(3, src, mask);
        assert!(!key.is_v4() && key.rule_id() == 3);
        assert_eq!(key.addr[..8], src[..8]);
        assert_eq!(key.addr[8..], [0; 8]);
    }

    #[test]
    fn names_lose_their_padding_and_counters_add_up() {
        let mut rule = RuleConfig::default();
        rule.name[..3].copy_from_slice(b"web");
        assert_eq!(rule.name(), b"web");
        rule.name = [b'x'; RULE_NAME_LEN];
        assert_eq!(rule.name().len(), RULE_NAME_LEN);
        let mut total = RuleCounters {
            passed_packets: 1,
            dropped_bytes: 2,
            ..RuleCounters::default()
        };
        total.add(&RuleCounters {
            passed_packets: 10,
            aggregate_excess: 5,
            ..RuleCounters::default()
        });
        assert_eq!(
            (
                total.passed_packets,
                total.dropped_bytes,
                total.aggregate_excess
            ),
            (11, 2, 5)
        );
    }
}
