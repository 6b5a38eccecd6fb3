//! The validated rule set and what it means: its types (a rule, its match,
//! its key, its limits) and what both layers ask of them (a rule's
//! meters, whether the kernel can enforce it, a fleet share of a rate).

use std::time::Duration;

use ipnet::IpNet;
use limiter_common::{gcra::Gcra, window::Window};

use super::{
    raw::{Algorithm, EscalateScope, Fallback, FragmentPolicy},
    request::{HttpRequest, KeyPart, RequestMatch},
};

/// Bytes a packet counts as when rules of packets and of bytes are
/// compared (`Rule::bytes_per_second_bound`): an Ethernet MTU's frame.
pub const FULL_FRAME: f64 = 1500.0;

/// A validated rule file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleSet {
    /// For traffic that matches no rule.
    pub default: Fallback,
    /// For frames the parser rejects.
    pub malformed: Fallback,
    /// Capacity of the per-key state map.
    pub max_keys: u32,
    /// Each rule's budget of key creations: beyond it, packets of sources
    /// not yet tracked are dropped (and counted as `unadmitted`). By
    /// default `max_keys` per minute, with a burst of a second's worth.
    pub new_keys: Rate,
    /// What bounds the blocks escalation makes.
    pub escalation: EscalationPolicy,
    /// Later fragments whose first fragment was not seen.
    pub fragments: FragmentPolicy,
    pub rules: Vec<Rule>,
}

/// The rule file's `escalation`: a key's refusals are evidence a forger
/// can produce, so escalation never blocks these prefixes (the operator's
/// own networks, its resolvers, its monitoring) and makes at most so many
/// blocks a minute; the escalations it leaves out are counted and logged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EscalationPolicy {
    pub never_block: Vec<IpNet>,
    pub max_per_minute: u32,
}

impl Default for EscalationPolicy {
    fn default() -> Self {
        Self {
            never_block: Vec::new(),
            max_per_minute: Self::DEFAULT_MAX_PER_MINUTE,
        }
    }
}

impl EscalationPolicy {
    /// Blocks escalation makes a minute unless the rule file says.
    pub const DEFAULT_MAX_PER_MINUTE: u32 = 60;

    /// The never-block prefix that overlaps `prefix`, if any.
    pub fn spares(&self, prefix: &IpNet) -> Option<&IpNet> {
        self.never_block
            .iter()
            .find(|n| n.contains(prefix) || prefix.contains(*n))
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    pub name: String,
    pub matches: Match,
    /// Layer 7: what the rule asks of a request besides its addresses.
    pub request: RequestMatch,
    /// Key granularity: the source prefix length that forms a key.
    pub key: KeyPrefix,
    /// What a key is made of: the source (masked by `key`) by default;
    /// at layer 7, also or instead headers, the path, the method, the host.
    pub keyed_by: Vec<KeyPart>,
    pub limit: Limit,
    /// Budgets shared by all the rule's keys together (hierarchical limits).
    pub aggregate: Option<Rates>,
    /// A soft packet (request) limit per key, below the hard one: what
    /// goes over it is counted (`over_soft`) and passed. GCRA only.
    pub soft: Option<Rate>,
    /// A second packet (request) limit on the same key (`limits: [...]`,
    /// say 10/s and 250/day): a packet passes only if both allow it. Kept
    /// in the meter a byte limit would use, so never with one.
    pub second_packets: Option<Rate>,
    /// A third limit on the same key (`limits: [...]` with three, say
    /// 10/s and 250/day and 1 MB/s; GCRA only): kept in the third word of
    /// the key's state, so never with `soft`.
    pub third: Option<ThirdLimit>,
    /// What a packet (request) costs its packet meters, by class (`cost`):
    /// the first class it is in; 1 when none. At most
    /// `abi::MAX_COST_CLASSES`.
    pub costs: Vec<CostClass>,
    /// A key over its limit for longer than `after` is blocked for `block`
    /// (the kernel: its source prefix, by the daemon or `limiter run`;
    /// layer 7: the key, for this rule).
    pub escalate: Option<limiter_common::escalation::Escalation>,
    /// What an escalation blocks at layer 3/4 (layer 7 holds the key).
    pub escalate_scope: EscalateScope,
    /// How every meter of the rule counts.
    pub algorithm: Algorithm,
    /// Pacing (layer 7 only): how long a request may be held until it
    /// conforms before it is refused instead.
    pub delay: Option<Duration>,
    /// Excess is counted and passed instead of dropped.
    pub shadow: bool,
    /// Layer 7: at most this many requests of one key in flight at once
    /// (nginx's `limit_conn`); not in the fingerprint, since the count of
    /// requests in flight means the same under any limit.
    pub concurrent: Option<u32>,
    /// The aggregate's packet budget is fleet-wide (`scope: fleet`).
    pub fleet: Option<FleetShare>,
}

/// A key's third limit: a packet (request) rate, charged credits as the
/// packet limit is, or a byte rate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ThirdLimit {
    pub rate: Rate,
    pub counts_bytes: bool,
}

/// How a fleet-wide aggregate is shared (see [`crate::fleet`]): its rate
/// is the fleet's, leased in `partitions` equal parts; each node enforces
/// its reserve plus the parts it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FleetShare {
    pub partitions: u32,
    /// Per the aggregate's unit, kept by each node whatever the store says.
    pub reserve: u64,
}

impl Rule {
    /// The first field of the rule only layer 7 can enforce, if any.
    pub fn layer7_field(&self) -> Option<&'static str> {
        self.request
            .first_field()
            .or_else(|| {
                // `key: all` is one bucket at either layer.
                (!self.keyed_by.is_empty() && self.keyed_by != [KeyPart::Source]).then_some("key")
            })
            .or_else(|| self.concurrent.is_some().then_some("concurrent"))
            .or_else(|| {
                self.costs
                    .iter()
                    .any(|c| !c.request.is_empty())
                    .then_some("cost (by a request's fields)")
            })
    }

    /// The rule's packet (request) limit per key, if it has one.
    pub fn packet_rate(&self) -> Option<Rate> {
        match self.limit {
            Limit::Metered { packets, .. } => packets,
            Limit::Unlimited => None,
        }
    }

    /// The key's limits in the words of its state, as both layers keep
    /// them: the packet limit; the byte limit, or else a second packet
    /// limit; the third limit (GCRA; the word a soft limit uses otherwise).
    pub fn key_meters(&self) -> [Option<&Rate>; 3] {
        match &self.limit {
            Limit::Metered { packets, bytes } => [
                packets.as_ref(),
                bytes.as_ref().or(self.second_packets.as_ref()),
                self.third.as_ref().map(|t| &t.rate),
            ],
            Limit::Unlimited => [None; 3],
        }
    }

    /// The most bytes a second one source may put through the rule, a
    /// packet counted as a full frame of [`FULL_FRAME`] bytes (what a
    /// later fragment is): the kernel charges a packet whose port is
    /// unknown to the rule of least (`compile`). A shadow rule refuses
    /// nothing, an exemption neither: unbounded.
    pub fn bytes_per_second_bound(&self) -> f64 {
        if self.shadow {
            return f64::INFINITY;
        }
        let Limit::Metered { packets, bytes } = self.limit else {
            return f64::INFINITY;
        };
        let per_second = |r: &Rate| r.rate as f64 / r.period.as_secs_f64();
        let frames = |r: &Rate| per_second(r) * FULL_FRAME;
        [
            packets.as_ref().map(frames),
            bytes.as_ref().map(per_second),
            self.second_packets.as_ref().map(frames),
            self.third.as_ref().map(|t| {
                if t.counts_bytes {
                    per_second(&t.rate)
                } else {
                    frames(&t.rate)
                }
            }),
            self.aggregate.and_then(|a| a.packets).as_ref().map(frames),
            self.aggregate
                .and_then(|a| a.bytes)
                .as_ref()
                .map(per_second),
        ]
        .into_iter()
        .flatten()
        .fold(f64::INFINITY, f64::min)
    }

    /// A fleet-wide rule's whole budget: its aggregate packet rate
    /// (validation makes every fleet rule have one).
    pub fn fleet_rate(&self) -> Option<Rate> {
        self.fleet?;
        self.aggregate?.packets
    }
}

impl Rate {
    /// This limit scaled to `local` per period: the burst in proportion
    /// (at least 1), so the nodes' bursts add up to about the fleet's; a
    /// meter that admits nothing when `local` is 0.
    pub fn share(&self, local: u64) -> Rate {
        let period_ns = u64::try_from(self.period.as_nanos()).unwrap_or(u64::MAX);
        let windowed = self.window.length_ns != 0;
        if local == 0 {
            return Rate {
                rate: 0,
                burst: 0,
                gcra: Gcra::CLOSED,
                window: if windowed {
                    Window::closed(period_ns)
                } else {
                    Window::default()
                },
                ..*self
            };
        }
        let burst = (u128::from(self.burst) * u128::from(local) / u128::from(self.rate.max(1)))
            .clamp(1, u128::from(self.burst.max(1))) as u64;
        // Validation proved the whole rate representable, so every smaller
        // share is (the burst shrinks with it).
        let gcra = Gcra::new(local, period_ns, burst).unwrap_or(Gcra::CLOSED);
        let window = if windowed {
            Window::new(local, period_ns).unwrap_or(Window::closed(period_ns))
        } else {
            Window::default()
        };
        Rate {
            rate: local,
            burst,
            gcra,
            window,
            ..*self
        }
    }
}

/// A packet rate, a byte rate, or both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rates {
    pub packets: Option<Rate>,
    pub bytes: Option<Rate>,
}

/// What a rule applies to. `source: None` means every address of both families.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Match {
    pub source: Option<IpNet>,
    pub protocol: Option<u8>,
    pub dest_port: Option<u16>,
    /// TCP segments whose flags, masked, have this value (`syn,!ack`).
    pub tcp_flags: Option<TcpFlags>,
}

/// A class of packets or requests and what each costs.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CostClass {
    /// Layer 3/4: TCP segments with these flags (`tcp_flags`).
    pub tcp_flags: Option<TcpFlags>,
    /// Layer 7: requests this matches (method, host, path, headers).
    pub request: RequestMatch,
    pub credits: u64,
}

impl CostClass {
    /// Whether a packet with these TCP flags (`None`: not a TCP segment)
    /// is in the class; a class of requests holds no packet.
    pub fn holds_packet(&self, tcp_flags: Option<u8>) -> bool {
        self.request.is_empty()
            && self
                .tcp_flags
                .is_some_and(|f| tcp_flags.is_some_and(|t| t & f.mask == f.value))
    }

    /// Whether a request is in the class; a class of segments holds none.
    pub fn holds_request(&self, request: &HttpRequest<'_>) -> bool {
        self.tcp_flags.is_none() && self.request.matches(Some(request))
    }
}

/// `match.tcp_flags`: the flags named (`mask`), and which of them must be
/// set (`value`); the rest must be clear.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct TcpFlags {
    pub mask: u8,
    pub value: u8,
}

impl TcpFlags {
    /// The flags' names, in the order of their bits.
    pub const NAMES: [&'static str; 8] = ["fin", "syn", "rst", "psh", "ack", "urg", "ece", "cwr"];

    /// As written in a rule file: `syn,!ack`.
    pub fn text(&self) -> String {
        (0..8)
            .filter(|bit| self.mask & (1 << bit) != 0)
            .map(|bit| {
                let name = Self::NAMES[bit];
                if self.value & (1 << bit) != 0 {
                    name.to_owned()
                } else {
                    format!("!{name}")
                }
            })
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// Prefix lengths that form a key: one bucket per source `/v4` or `/v6`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyPrefix {
    pub v4: u8,
    pub v6: u8,
}

impl KeyPrefix {
    /// One bucket per IPv4 address and per IPv6 /64 (one host owns a /64).
    pub const DEFAULT: Self = Self { v4: 32, v6: 64 };
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limit {
    Unlimited,
    Metered {
        packets: Option<Rate>,
        bytes: Option<Rate>,
    },
}

/// `rate` per `period`, with `burst` headroom, and the parameters of the
/// meter (GCRA or window) that enforces it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rate {
    pub rate: u64,
    pub period: Duration,
    /// GCRA only (windows admit `rate` per window).
    pub burst: u64,
    pub gcra: Gcra,
    pub window: Window,
}

/// A rule the kernel cannot enforce ([`RuleSet::kernel_compatible`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "rules[{index}] ({name:?}): {what} works at layer 7 only (limiter proxy or the library); \
     the kernel sees packets, and cannot queue, log or parse requests"
)]
pub struct Layer7Only {
    /// Its index in the file.
    pub index: usize,
    pub name: String,
    /// What in it needs layer 7 (`algorithm sliding_log`, `limit.delay
    /// (pacing)`, a request's field).
    pub what: String,
}

impl RuleSet {
    /// Whether the kernel can enforce every rule: the sliding log and
    /// pacing need per-request logs and queues, which XDP cannot keep.
    pub fn kernel_compatible(&self) -> Result<(), Layer7Only> {
        for (i, rule) in self.rules.iter().enumerate() {
            let what = if rule.algorithm == Algorithm::SlidingLog {
                "algorithm sliding_log".to_owned()
            } else if rule.delay.is_some() {
                "limit.delay (pacing)".to_owned()
            } else if let Some(field) = rule.layer7_field() {
                let parts: Vec<String> = rule.keyed_by.iter().map(KeyPart::name).collect();
                match field {
                    "key" if parts.is_empty() => {
                        "key all (in the kernel, an aggregate is one budget for every key)"
                            .to_owned()
                    }
                    "key" => format!("key {} (a request's fields)", parts.join(" + ")),
                    "concurrent" => "concurrent (requests in flight)".to_owned(),
                    field => format!("{field} (a request's field)"),
                }
            } else {
                continue;
            };
            return Err(Layer7Only {
                index: i,
                name: rule.name.clone(),
                what,
            });
        }
        Ok(())
    }

    /// Whether any rule asks what only layer 7 can tell.
    pub fn has_layer7_rules(&self) -> bool {
        self.rules.iter().any(|r| r.layer7_field().is_some())
    }
}
