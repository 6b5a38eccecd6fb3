//! Layer 7: the same rule file and the same `limiter-common` functions as
//! the kernel, applied to requests. A rule matches a request by its client
//! address (TCP, the service's port), keys it by the same masked address as
//! the kernel (or by a header, or any key the caller extracts), and meters
//! it with the same GCRA or window code: one request costs 1 against
//! packet (`rate`) limits, and its size against byte (`bytes`) limits.

pub mod client;
mod fleet;
pub mod forwarded;
pub mod headers;
mod keys;
pub mod layer;
pub mod proxy;
mod reload;
pub mod striped;
pub mod trace;

use std::{
    cell::Cell,
    net::IpAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use limiter_common::{
    abi::FlowKey,
    escalation::Escalation,
    gcra::{Decision, Gcra},
    log::Log,
    meter::{
        AtomicCell, Charge, Outcome, Verdict, WindowCharge, acquire, acquire_all,
        acquire_all_after, acquire_delayed, order, windows_all,
    },
    trace::reason,
    window::WindowState,
};
use once_cell::race::OnceBox;
use serde::Serialize;

pub use layer::{BodyCharge, ClientAddr, CostBy, KeyBy, RateLimit, RateLimitLayer};
pub use reload::Reloadable;

use crate::rules::{
    Algorithm, Fallback, HttpRequest, KeyPart, Limit, Rate, Rule, RuleSet,
    matching::{RequestRules, key_masks},
};

/// Where the limiter reads the time: monotonic ns for GCRA, Unix-epoch ns
/// for windows (aligned to the epoch, as envoy's). Tests drive their own.
pub trait Clock: Send + Sync {
    fn monotonic_ns(&self) -> u64;
    fn epoch_ns(&self) -> u64;
}

/// The system's clocks: `CLOCK_MONOTONIC` read from the CPU's counter
/// ([`crate::clock::counter_monotonic_ns`]).
pub struct SystemClock;

impl Clock for SystemClock {
    #[inline]
    fn monotonic_ns(&self) -> u64 {
        crate::clock::counter_monotonic_ns()
    }

    fn epoch_ns(&self) -> u64 {
        crate::clock::realtime_ns()
    }
}

/// One request as the limiter sees it.
#[derive(Clone, Copy, Debug)]
pub struct RequestMeta<'a> {
    pub client: IpAddr,
    /// The service's port, for rules that name `dest_port`.
    pub port: Option<u16>,
    /// A key to use instead of the client's address (e.g. an API token).
    pub key: Option<&'a [u8]>,
    /// Cost against byte limits.
    pub bytes: u64,
    /// The request's method, URI and headers, for rules with layer-7
    /// conditions or keys (`None`: such rules never apply).
    pub http: Option<HttpRequest<'a>>,
}

/// What to tell the client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Admission {
    /// Forward the request.
    pub allowed: bool,
    /// Excess let through by a dry run.
    pub shadow: bool,
    /// The index of the rule that applied (`None`: the default); its name
    /// is [`Limiter::rule_name`]'s.
    pub rule: Option<usize>,
    /// What the rule's packet (request) limit said, for [`Limiter::quota`]:
    /// the fields are computed only for a response that carries them.
    quota: Option<QuotaAt>,
    /// Pacing: hold the request this long before forwarding it.
    pub delay_ns: u64,
    /// The request counted in flight under its rule's `concurrent` limit:
    /// hold it until the response is over.
    pub in_flight: Option<Arc<InFlight>>,
    /// Refused (or, under a dry run, let through) because its key had as
    /// many requests in flight as its rule's `concurrent` allows.
    pub too_many_in_flight: bool,
    /// What refused it (`limiter_common::trace::reason`), if refused
    /// (or let through by a dry run): for `limiter proxy --trace`.
    pub refused_by: Option<u8>,
    /// Admitted over the rule's soft limit: the response says so.
    pub over_soft: bool,
    /// Refused because `escalate` blocked its key: for this long still.
    pub blocked_for_ns: u64,
}

/// What a request (or a streamed body's chunk) is charged.
#[derive(Clone, Copy)]
struct Charges<'a> {
    /// Each meter's limit, in [`order`] (borrowed: a request copies no
    /// limit).
    rates: [Option<&'a Rate>; order::METERS],
    /// What each meter charges.
    costs: [u64; order::METERS],
    /// The key's third limit (GCRA) and what it charges, if it does.
    third: Option<(Gcra, u64)>,
}

/// A key's request meter as the request left it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum QuotaAt {
    /// GCRA: the theoretical arrival times of its meters (the second: a
    /// second packet limit's, if the rule has one; the third: a third
    /// limit's), and when it was judged.
    Gcra {
        tats: [u64; 3],
        now: u64,
        /// The request's cost: `Retry-After` says when one of it conforms.
        cost: u64,
        /// A refusal by another meter (bytes, the aggregate, a third
        /// limit): how long until that one takes the request.
        refused_wait_ns: u64,
    },
    /// Windows and logs: read under their locks at once.
    Ready(Quota),
}

impl Admission {
    /// A decision with no meter behind it; `refused_by` what refused it.
    fn plain(allowed: bool, shadow: bool, rule: Option<usize>, refused_by: Option<u8>) -> Self {
        Self {
            allowed,
            shadow,
            rule,
            quota: None,
            delay_ns: 0,
            in_flight: None,
            too_many_in_flight: false,
            refused_by,
            over_soft: false,
            blocked_for_ns: 0,
        }
    }
}

/// One request counted against its key's `concurrent` limit, until this
/// is dropped.
pub struct InFlight(Arc<State>);

impl InFlight {
    /// Counts a request in flight, unless `max` already are.
    fn enter(state: &Arc<State>, max: u32) -> Option<Self> {
        let in_flight = &state.cold().in_flight;
        let before = in_flight.fetch_add(1, Ordering::AcqRel);
        if before >= u64::from(max) {
            in_flight.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(Self(Arc::clone(state)))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.cold().in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

impl PartialEq for InFlight {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for InFlight {}

impl std::fmt::Debug for InFlight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.0.cold().in_flight.load(Ordering::Relaxed);
        write!(f, "InFlight({n} of this key)")
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Quota {
    /// Requests per window.
    pub quota: u64,
    pub window_secs: u64,
    /// Requests left now.
    pub remaining: u64,
    /// Seconds until the quota is whole again.
    pub reset_secs: u64,
    /// Seconds until a refused request would be admitted.
    pub retry_after_secs: u64,
}

/// Counters per rule, as the kernel keeps them.
#[derive(Default)]
pub struct HttpCounters {
    // Added to at every request: striped (see [`striped`]).
    pub passed: striped::StripedCounter,
    pub dropped: striped::StripedCounter,
    pub shadow: striped::StripedCounter,
    /// Admitted requests whose streaming body a byte limit cut short.
    pub bodies_cut: AtomicU64,
    /// The same under a dry run: counted, not cut.
    pub shadow_bodies: AtomicU64,
    /// Of `dropped` and `shadow`: those the rule's aggregate refused (a
    /// fleet rule's demand for more of the fleet's budget).
    pub aggregate_excess: AtomicU64,
    /// Of `dropped` and `shadow`: those whose key had as many requests in
    /// flight as the rule's `concurrent` allows.
    pub in_flight_excess: AtomicU64,
    /// Of `passed`: those over the rule's soft limit.
    pub over_soft: AtomicU64,
    /// Keys blocked (or, under a dry run, counted) by `escalate`.
    pub escalations: AtomicU64,
}

/// State of one key (or of a rule's aggregate): GCRA cells for the
/// request meter (0) and the byte meter (1), and the cell of the soft
/// request meter (2, as the kernel keeps it in a key's third word), then
/// last-seen and the escalation block: what every request reads. With
/// the `Arc`'s counts it is 64 bytes, one cache line under mimalloc (the
/// daemon's allocator, whose 64-byte blocks are 64-byte aligned): at
/// 10,000 keys, a larger state, or one over two lines, is more misses per
/// request. What only some rules' keys use is apart ([`Cold`]), made at
/// its first use.
#[derive(Default)]
#[repr(C)]
struct State {
    cells: [AtomicU64; 3],
    /// When the key was last seen (monotonic ns), for eviction, stored at
    /// most once a [`SEEN_GRANULE_NS`].
    last_seen: AtomicU64,
    /// Escalation (`escalate`): until when the key is blocked (monotonic
    /// ns; 0: not blocked).
    blocked_until: AtomicU64,
    cold: OnceBox<Cold>,
}

/// What a key of some rules keeps besides its meters: escalation's watch,
/// the requests in flight, the window and log algorithms' counts. A key
/// of a plain GCRA rule never makes it.
#[derive(Default)]
struct Cold {
    /// Escalation: since when the key has been over its limit at every
    /// request (0: it was not at the last), and when one of its requests
    /// was last refused (monotonic ns).
    over_since: AtomicU64,
    last_refused: AtomicU64,
    /// Requests in flight (rules with `concurrent`).
    in_flight: AtomicU64,
    /// Made only for the window and log algorithms' keys (a hundred and
    /// more bytes an escalated or counted-in-flight GCRA key does not
    /// need).
    counts: OnceBox<Counts>,
}

#[derive(Default)]
struct Counts {
    windows: Mutex<[WindowState; 2]>,
    logs: Mutex<[Log; 2]>,
}

/// How far `State::last_seen` may lag: the requests of one key do not all
/// write its cache line. (For a key whose state says when it rests, a
/// request's store may land after a later one's: see [`State::seen`].)
const SEEN_GRANULE_NS: u64 = 1_000_000;

impl State {
    fn cold(&self) -> &Cold {
        self.cold.get_or_init(Box::default)
    }

    fn counts(&self) -> &Counts {
        self.cold().counts.get_or_init(Box::default)
    }

    fn windows(&self) -> &Mutex<[WindowState; 2]> {
        &self.counts().windows
    }

    fn logs(&self) -> &Mutex<[Log; 2]> {
        &self.counts().logs
    }

    /// Seen at `now` (monotonic ns; 0: not judged, nothing to note).
    /// `rests_by_state`: the key's state says itself when it rests (a
    /// metered GCRA rule's, [`rest_ns`] `None`), and when it was seen only
    /// ranks it for eviction among keys at rest: a plain store does,
    /// though a request judged earlier may store last (at 10,000 keys, a
    /// locked max here was a tenth of a check). Other keys (windows, logs,
    /// unlimited rules) rest a span after they were last seen, so that
    /// never goes back.
    fn seen(&self, now: u64, rests_by_state: bool) {
        seen(&self.last_seen, now, rests_by_state);
    }

    fn last_seen(&self) -> u64 {
        last_seen(&self.last_seen)
    }
}

/// Notes in a key's last-seen `cell` that it was seen at `now` (see
/// [`State::seen`]).
#[inline]
fn seen(cell: &AtomicU64, now: u64, rests_by_state: bool) {
    if cell.load(Ordering::Relaxed).saturating_add(SEEN_GRANULE_NS) <= now {
        if rests_by_state {
            cell.store(now, Ordering::Relaxed);
        } else {
            cell.fetch_max(now, Ordering::Relaxed);
        }
    }
}

/// No earlier than when a key was last seen, by its last-seen `cell` (for
/// a key whose state says when it rests, about then: see [`State::seen`]).
fn last_seen(cell: &AtomicU64) -> u64 {
    cell.load(Ordering::Relaxed).saturating_add(SEEN_GRANULE_NS)
}

/// Whether `rule` is plain: one GCRA request limit per key, charged a
/// credit a request, and nothing besides (no pacing, byte or second or
/// third limit, aggregate, fleet share, in-flight cap, escalation, soft
/// limit, dry run or credit classes).
fn is_plain(rule: &Rule) -> bool {
    let [packets, second, _] = rule.key_meters();
    rule.algorithm == Algorithm::Gcra
        && packets.is_some()
        && second.is_none()
        && rule.delay.is_none()
        && rule.third.is_none()
        && rule.aggregate.is_none()
        && rule.fleet.is_none()
        && rule.concurrent.is_none()
        && rule.escalate.is_none()
        && rule.soft.is_none()
        && !rule.shadow
        && rule.costs.is_empty()
}

/// `request` from the IPv4 client it is from, if a dual-stack listener saw
/// it as `::ffff:a.b.c.d` (`None` otherwise: the request as it is, not
/// copied on every request).
fn ipv4_mapped<'r>(request: &RequestMeta<'r>) -> Option<RequestMeta<'r>> {
    match request.client {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(|v4| RequestMeta {
            client: IpAddr::V4(v4),
            ..*request
        }),
        IpAddr::V4(_) => None,
    }
}

/// How long a key of `rule` must go unseen before its state is what a new
/// key starts with: a window's counts expire within two windows, a log's
/// entries within one. `None` for GCRA, whose state says it exactly.
fn rest_ns(rule: &Rule) -> Option<u64> {
    if matches!(rule.limit, Limit::Unlimited) {
        return Some(0);
    }
    if rule.algorithm == Algorithm::Gcra {
        return None;
    }
    Some(
        rule.key_meters()
            .into_iter()
            .flatten()
            .map(|m| match rule.algorithm {
                Algorithm::SlidingLog => m.window.length_ns,
                _ => m.window.length_ns.saturating_mul(2),
            })
            .max()
            .unwrap_or(0),
    )
}

/// A key's identity: the rule's index and either the masked client address
/// or a digest of the caller's key. A digest, not the bytes: a client
/// sending 8 KB header values would otherwise make every key cost 8 KB.
/// Keyed per process (as std's maps are), so no one can aim two keys at
/// one digest; 128 bits, so no two keys meet by chance.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum KeyBytes {
    Addr([u8; 16]),
    Custom([u8; 16]),
}

/// Two randomly keyed SipHash instances (std's `RandomState`): a 128-bit
/// digest no one without the keys can aim.
struct KeyDigest([std::hash::RandomState; 2]);

impl KeyDigest {
    fn new() -> Self {
        Self([std::hash::RandomState::new(), std::hash::RandomState::new()])
    }

    /// The digest of a key made of `parts` (each hashed with its length,
    /// so no two lists of parts meet by concatenation).
    fn of(&self, parts: &[&[u8]]) -> [u8; 16] {
        use std::hash::{BuildHasher, Hash, Hasher};
        let [a, b] = &self.0;
        let digest = |state: &std::hash::RandomState| {
            let mut hasher = state.build_hasher();
            for part in parts {
                part.hash(&mut hasher);
            }
            hasher.finish()
        };
        let mut out = [0; 16];
        out[..8].copy_from_slice(&digest(a).to_ne_bytes());
        out[8..].copy_from_slice(&digest(b).to_ne_bytes());
        out
    }
}

/// The byte meters of an admitted request whose size was unknown when it
/// was admitted (a chunked upload, no `Content-Length`): its body is
/// charged as it streams ([`Limiter::charge_body`]).
#[derive(Clone)]
pub struct BodyMeter {
    index: usize,
    state: Arc<State>,
    /// The most one charge may be (see [`crate::http::BodyCharge::max_cost`]).
    max_cost: u64,
}

/// A key's identity in the store: its rule's index and its bytes, in
/// words (bytes at odd offsets cost a stalled load at every lookup).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct StateKey {
    words: [u64; 2],
    rule: u32,
    /// The bytes are a digest ([`KeyBytes::Custom`]), not an address.
    custom: bool,
}

impl StateKey {
    fn new(rule: usize, bytes: KeyBytes) -> Self {
        let (custom, bytes) = match bytes {
            KeyBytes::Addr(a) => (false, a),
            KeyBytes::Custom(a) => (true, a),
        };
        let word = |i: usize| u64::from_ne_bytes(bytes[i * 8..][..8].try_into().expect("8 bytes"));
        Self {
            words: [word(0), word(1)],
            // Validation keeps rules fewer than `abi::MAX_RULES`.
            rule: u32::try_from(rule).expect("rule index fits u32"),
            custom,
        }
    }

    fn rule(&self) -> usize {
        self.rule as usize
    }

    /// The key of an IPv4 client's (masked) address `addr` (as
    /// [`keys::PlainKeys`] keeps it) under rule `rule`.
    fn v4(rule: usize, addr: u32) -> Self {
        Self::new(
            rule,
            KeyBytes::Addr(FlowKey::v4(0, addr.to_be_bytes(), [0xff; 4]).addr),
        )
    }

    /// The IPv4 client address this key is (as [`StateKey::v4`] takes
    /// it), if it is one.
    fn ipv4(&self) -> Option<u32> {
        // The address's bytes end the second word.
        let [.., b] = self.words.map(u64::to_ne_bytes);
        let addr = u32::from_be_bytes([b[4], b[5], b[6], b[7]]);
        (*self == Self::v4(self.rule(), addr)).then_some(addr)
    }

    /// The same key under another rule's index (a reload's).
    fn new_rule(self, rule: usize) -> Self {
        Self {
            rule: u32::try_from(rule).expect("rule index fits u32"),
            ..self
        }
    }
}

impl std::hash::Hash for StateKey {
    /// In three words: derived, it hashed the array's length too.
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write_u64(self.words[0]);
        state.write_u64(self.words[1]);
        state.write_u64(u64::from(self.rule) << 1 | u64::from(self.custom));
    }
}

/// The GCRA cell of meter `i` (in [`order`]): each state keeps its packet
/// meter, then its byte meter; the aggregate's meters are the rule's.
fn gcra_cell<'s>(i: usize, state: &'s State, aggregate: &'s State) -> &'s AtomicU64 {
    let state = if order::is_aggregate(i) {
        aggregate
    } else {
        state
    };
    &state.cells[usize::from(order::charges_bytes(i))]
}

/// How long until meter `refused_by` of `charges` (a GCRA meter other than
/// the key's requests: bytes, the aggregate, a third limit) would take the
/// request it refused at `now` (0 for the key's requests, which the
/// request's quota says itself): its `Retry-After`.
fn refused_wait_ns_of(
    charges: &Charges<'_>,
    refused_by: usize,
    (state, aggregate): (&State, &State),
    now: u64,
) -> u64 {
    let refusing = match (refused_by, charges.third) {
        (order::KEY_THIRD, Some((gcra, cost))) => Some((&state.cells[2], gcra, cost)),
        (order::KEY_PACKETS, _) | (order::KEY_THIRD, None) => None,
        (i, _) => charges
            .rates
            .get(i)
            .copied()
            .flatten()
            .map(|m| (gcra_cell(i, state, aggregate), m.gcra, charges.costs[i])),
    };
    refusing.map_or(0, |(cell, gcra, cost)| {
        gcra.wait_ns(cell.load(Ordering::Acquire), now, cost)
    })
}

pub struct Limiter {
    rules: RuleSet,
    /// Which rule applies to a request (the kernel's order), by source.
    matcher: RequestRules,
    /// By rule index: what its responses always say.
    header_fields: Vec<headers::RuleFields>,
    clock: Arc<dyn Clock>,
    /// By (rule index, key); a plain rule's keys of IPv4 clients by (its
    /// slot, address), shared with the limiters reloads make.
    keys: keys::KeyStore,
    /// By rule index: see [`rest_ns`].
    rest_ns: Vec<Option<u64>>,
    /// By rule index: the masks of its client-address keys (IPv4, IPv6).
    key_masks: Vec<([u8; 4], [u8; 16])>,
    /// Shared with the limiters a reload makes, so keys keep their digests.
    digest: Arc<KeyDigest>,
    /// By rule index; shared with a reload's limiter for unchanged rules.
    aggregates: Vec<Arc<State>>,
    pub counters: Vec<Arc<HttpCounters>>,
    /// By rule index: the share of a fleet rule's aggregate.
    fleet: Vec<Option<fleet::FleetMeter>>,
    /// By rule index: for a rule of one GCRA request limit and nothing
    /// besides (a plain per-client limit), which [`Limiter::decide_plain`]
    /// judges, its slot among the plain keys ([`keys::PlainKeys`]).
    plain: Vec<Option<u32>>,
}

impl Limiter {
    pub fn new(rules: RuleSet, clock: Arc<dyn Clock>) -> Self {
        let n = rules.rules.len();
        let rest = rules.rules.iter().map(rest_ns).collect();
        let keys = keys::KeyStore::new(rules.max_keys as usize);
        // The first read calibrates the clock: at start, not at a request.
        clock.monotonic_ns();
        Self {
            aggregates: (0..n).map(|_| Arc::default()).collect(),
            fleet: rules.rules.iter().map(fleet::FleetMeter::of).collect(),
            plain: (rules.rules.iter())
                .map(|r| is_plain(r).then(|| keys.plain.new_slot()))
                .collect(),
            counters: (0..n).map(|_| Arc::default()).collect(),
            matcher: RequestRules::new(&rules),
            header_fields: rules.rules.iter().map(headers::RuleFields::of).collect(),
            key_masks: rules.rules.iter().map(key_masks).collect(),
            rules,
            clock,
            keys,
            rest_ns: rest,
            digest: Arc::new(KeyDigest::new()),
        }
    }

    pub fn rules(&self) -> &RuleSet {
        &self.rules
    }

    /// Keys with state now.
    pub fn tracked_keys(&self) -> usize {
        self.keys.len()
    }

    /// New keys refused so far because every key kept was still in debt.
    pub fn key_alloc_failures(&self) -> u64 {
        self.keys.refused.load(Ordering::Relaxed)
    }

    /// The rule that applies to `request`, if any, its client canonical
    /// ([`ipv4_mapped`]): a dual-stack listener sees IPv4 clients as
    /// `::ffff:a.b.c.d`, and they are IPv4 clients, under IPv4 rules and
    /// IPv4 keys.
    #[inline(always)]
    fn rule_of(&self, request: &RequestMeta<'_>) -> Option<usize> {
        debug_assert!(ipv4_mapped(request).is_none(), "not canonical");
        self.matcher.first(
            &self.rules,
            &request.client,
            &request.port,
            request.http.as_ref(),
        )
    }

    /// The byte meters that will charge `request`'s body as it streams, if
    /// its rule limits bytes (see [`BodyMeter`]).
    pub fn body_meter(&self, request: &RequestMeta<'_>) -> Option<BodyMeter> {
        if let Some(request) = ipv4_mapped(request) {
            return self.body_meter(&request);
        }
        let index = self.rule_of(request)?;
        let rule = &self.rules.rules[index];
        let Limit::Metered { bytes, .. } = rule.limit else {
            return None;
        };
        let aggregate_bytes = rule.aggregate.and_then(|a| a.bytes);
        if (bytes.is_none() && aggregate_bytes.is_none()) || rule.delay.is_some() {
            return None;
        }
        let key = self.state_key(index, rule, request);
        let clock = &self.clock;
        let state = self.keys.with(
            key,
            || clock.monotonic_ns(),
            &self.rest_ns,
            |state| {
                self.seen(index, state, clock.monotonic_ns());
                Some(Arc::clone(state))
            },
            || None,
        )?;
        // A third limit in bytes is charged the body too.
        let third_bytes = rule.third.filter(|t| t.counts_bytes).map(|t| t.rate);
        let max_cost = [bytes, aggregate_bytes, third_bytes]
            .into_iter()
            .flatten()
            .map(|m| match rule.algorithm {
                Algorithm::Gcra => m.burst,
                _ => m.window.limit,
            })
            .min()
            .unwrap_or(u64::MAX);
        Some(BodyMeter {
            index,
            state,
            max_cost,
        })
    }

    /// Charges `n` more bytes of a streaming body to its key's and its
    /// rule's byte limits, all or none: `false` when they refuse.
    pub fn charge_body(&self, meter: &BodyMeter, n: u64) -> bool {
        let rule = &self.rules.rules[meter.index];
        let Limit::Metered { bytes, .. } = rule.limit else {
            return true;
        };
        let mut rates: [Option<&Rate>; order::METERS] = [None; order::METERS];
        rates[order::KEY_BYTES] = bytes.as_ref();
        rates[order::AGGREGATE_BYTES] = rule.aggregate.as_ref().and_then(|a| a.bytes.as_ref());
        let aggregate = &self.aggregates[meter.index];
        let judged_at = Cell::new(0);
        // The third limit only if it counts bytes.
        let third = rule
            .third
            .filter(|t| t.counts_bytes)
            .map(|t| (t.rate.gcra, n));
        let charges = Charges {
            rates,
            costs: [n; order::METERS],
            third,
        };
        let verdict = self.meter(rule, &meter.state, aggregate, &charges, &judged_at);
        // A long upload keeps its key recent: evicting it would hand the
        // client a fresh budget.
        self.seen(meter.index, &meter.state, judged_at.get());
        verdict.outcome == Outcome::Allowed
    }

    /// Counts a streaming body refused by [`Limiter::charge_body`] (once a
    /// body: `first`); whether it goes on anyway (a dry run).
    pub fn count_body_over_limit(&self, meter: &BodyMeter, first: bool) -> bool {
        let rule = &self.rules.rules[meter.index];
        if first {
            let counters = &self.counters[meter.index];
            let counter = if rule.shadow {
                &counters.shadow_bodies
            } else {
                &counters.bodies_cut
            };
            counter.fetch_add(1, Ordering::Relaxed);
        }
        rule.shadow
    }

    /// Meters one request and decides.
    pub fn check(&self, request: &RequestMeta<'_>) -> Admission {
        if let Some(request) = ipv4_mapped(request) {
            return self.check(&request);
        }
        let Some(index) = self.rule_of(request) else {
            let allowed = self.rules.default == Fallback::Pass;
            let refused_by = (!allowed).then_some(reason::RULE_BLOCKS);
            return Admission::plain(allowed, false, None, refused_by);
        };
        let rule = &self.rules.rules[index];
        let clock = &self.clock;
        // No room for a new key: refused, as the kernel refuses one.
        let full = || self.excess(index, reason::NO_SLOT);
        let Some(key) = self.plain_key(index, rule, request) else {
            return self.check_keyed(index, rule, request);
        };
        // A key a reload left among the others (see `share_keys`).
        let elsewhere = || {
            let key = StateKey::v4(index, key as u32);
            self.keys
                .get(&key, |state| self.decide(index, request, state))
        };
        self.keys.with_plain(
            key,
            || clock.monotonic_ns(),
            &self.rest_ns,
            |state| self.decide_plain(index, rule, (&state.tat, &state.last_seen)),
            elsewhere,
            full,
        )
    }

    /// [`Limiter::check`] of a request whose key is not a plain key (out
    /// of line: the plain key's path is the one kept short).
    #[inline(never)]
    fn check_keyed(&self, index: usize, rule: &Rule, request: &RequestMeta<'_>) -> Admission {
        if matches!(rule.limit, Limit::Unlimited) && rule.concurrent.is_none() {
            return Admission::plain(true, false, Some(index), None);
        }
        let clock = &self.clock;
        let key = self.state_key(index, rule, request);
        self.keys.with(
            key,
            || clock.monotonic_ns(),
            &self.rest_ns,
            |state| self.decide(index, request, state),
            || self.excess(index, reason::NO_SLOT),
        )
    }

    /// The request's key among the plain keys ([`keys::PlainKeys`]): a
    /// plain rule's, keyed by an IPv4 client's address.
    #[inline]
    fn plain_key(&self, index: usize, rule: &Rule, request: &RequestMeta<'_>) -> Option<u64> {
        let slot = self.plain[index]?;
        match (request.client, request.key, rule.keyed_by.as_slice()) {
            (IpAddr::V4(addr), None, [KeyPart::Source]) => {
                let mask = u32::from_be_bytes(self.key_masks[index].0);
                Some(keys::PlainKeys::key(slot, u32::from(addr) & mask))
            }
            _ => None,
        }
    }

    /// A key of rule `index` seen at `now` (see [`State::seen`]: whether
    /// its state says when it rests is the rule's [`rest_ns`]).
    #[inline]
    fn seen(&self, index: usize, state: &State, now: u64) {
        state.seen(now, self.rest_ns[index].is_none());
    }

    /// Counts a request refused (or, under a dry run, let through) and
    /// says so.
    fn excess(&self, index: usize, refused_by: u8) -> Admission {
        let rule = &self.rules.rules[index];
        let counters = &self.counters[index];
        let counter = if rule.shadow {
            &counters.shadow
        } else {
            &counters.dropped
        };
        counter.add(1);
        Admission::plain(rule.shadow, rule.shadow, Some(index), Some(refused_by))
    }

    /// [`Limiter::check`] once the request's key state is found.
    fn decide(&self, index: usize, request: &RequestMeta<'_>, state: &Arc<State>) -> Admission {
        let rule = &self.rules.rules[index];
        // A block a reload's rule left on the key goes the long way.
        if self.plain[index].is_some() && state.blocked_until.load(Ordering::Relaxed) == 0 {
            return self.decide_plain(index, rule, (&state.cells[0], &state.last_seen));
        }
        // (Unlimited: none, but counted in flight.)
        let [packets, key_bytes, _] = rule.key_meters();
        let counters = &self.counters[index];
        // A key its escalation blocked is refused before anything else
        // (under a dry run, passed and counted), and charged nothing.
        let blocked_until = state.blocked_until.load(Ordering::Relaxed);
        if blocked_until != 0 {
            let now = self.clock.monotonic_ns();
            if now < blocked_until {
                return Admission {
                    blocked_for_ns: blocked_until - now,
                    ..self.excess(index, reason::ESCALATED)
                };
            }
        }
        // Counted in flight first: a request refused for that is charged
        // nothing; one the meters refuse is no longer in flight.
        let in_flight = match rule.concurrent {
            None => None,
            Some(max) => match InFlight::enter(state, max) {
                Some(entered) => Some(Arc::new(entered)),
                None => {
                    counters.in_flight_excess.fetch_add(1, Ordering::Relaxed);
                    return Admission {
                        too_many_in_flight: true,
                        ..self.excess(index, reason::IN_FLIGHT)
                    };
                }
            },
        };
        // A request's credits (`cost`): its class's, or 1.
        let credits = request.http.as_ref().map_or(1, |http| {
            rule.costs
                .iter()
                .find(|class| class.holds_request(http))
                .map_or(1, |class| class.credits)
        });
        let mut delay_ns = 0;
        let mut by_aggregate = false;
        let mut refused_by = None;
        let mut refused_wait_ns = 0;
        let judged_at = Cell::new(0);
        // A lone request limit (most rules): its one meter alone, as
        // `acquire_all` charges an array of it alone.
        let lone = packets.filter(|_| {
            key_bytes.is_none()
                && rule.third.is_none()
                && rule.aggregate.is_none()
                && self.fleet[index].is_none()
        });
        let allowed = match (rule.algorithm, rule.delay, lone) {
            (Algorithm::Gcra, Some(delay), _) => {
                // Validation allows pacing only on a lone packet meter.
                let max = u64::try_from(delay.as_nanos()).unwrap_or(u64::MAX);
                let gcra = packets.as_ref().map(|m| m.gcra).unwrap_or_default();
                let now = self.clock.monotonic_ns();
                judged_at.set(now);
                match acquire_delayed(&state.cells[0], &gcra, now, credits, max) {
                    Some(wait) => {
                        delay_ns = wait;
                        true
                    }
                    None => {
                        refused_by = Some(order::KEY_PACKETS as u8);
                        false
                    }
                }
            }
            (Algorithm::Gcra, None, Some(limit)) => {
                let now = self.judging_clock(&judged_at);
                let outcome = acquire(&state.cells[0], &limit.gcra, now, credits);
                if outcome != Outcome::Allowed {
                    refused_by = Some(order::KEY_PACKETS as u8);
                }
                outcome == Outcome::Allowed
            }
            _ => {
                let aggregate = &self.aggregates[index];
                // In `order`: the key's packets and bytes, the aggregate's.
                let aggregate_packets = self.aggregate_packets(index);
                let mut rates: [Option<&Rate>; order::METERS] = [None; order::METERS];
                rates[order::KEY_PACKETS] = packets;
                // A second packet limit takes the byte meter's place, as in the
                // kernel (validation keeps the two apart).
                rates[order::KEY_BYTES] = key_bytes;
                rates[order::AGGREGATE_PACKETS] = aggregate_packets.as_deref();
                rates[order::AGGREGATE_BYTES] =
                    rule.aggregate.as_ref().and_then(|a| a.bytes.as_ref());
                let second_counts_packets = rule.second_packets.is_some();
                let third_counts_bytes = rule.third.as_ref().is_some_and(|t| t.counts_bytes);
                let cost = |bytes: bool| if bytes { request.bytes } else { credits };
                let costs: [u64; order::METERS] = std::array::from_fn(|i| {
                    cost(
                        order::charges_bytes(i)
                            && !(i == order::KEY_BYTES && second_counts_packets),
                    )
                });
                let charges = Charges {
                    rates,
                    costs,
                    third: rule
                        .third
                        .as_ref()
                        .map(|t| (t.rate.gcra, cost(third_counts_bytes))),
                };
                let verdict = self.meter(rule, state, aggregate, &charges, &judged_at);
                by_aggregate =
                    verdict.outcome == Outcome::Denied && order::is_aggregate(verdict.refused_by);
                if verdict.outcome != Outcome::Allowed {
                    refused_by = Some(match verdict.refused_by {
                        order::KEY_THIRD => order::KEY_THIRD as u8,
                        i => i.min(order::METERS - 1) as u8,
                    });
                }
                if verdict.outcome == Outcome::Denied && rule.algorithm == Algorithm::Gcra {
                    refused_wait_ns = refused_wait_ns_of(
                        &charges,
                        verdict.refused_by,
                        (state, aggregate),
                        judged_at.get(),
                    );
                }
                verdict.outcome == Outcome::Allowed
            }
        };
        let now = judged_at.get();
        self.seen(index, state, now);
        // The soft meter, charged like the kernel's: only what the hard
        // limits admitted, never refusing.
        let over_soft = allowed
            && rule.soft.is_some_and(|soft| {
                rule.algorithm == Algorithm::Gcra
                    && acquire(&state.cells[2], &soft.gcra, now, credits) == Outcome::Denied
            });
        if over_soft {
            counters.over_soft.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(escalation) = rule.escalate {
            // Refused by its own meters, not by the rule's aggregate (a
            // flood elsewhere spending the shared budget is not its doing).
            if !allowed && refused_by.is_some_and(|i| !order::is_aggregate(usize::from(i))) {
                state
                    .cold()
                    .last_refused
                    .store(now.max(1), Ordering::Relaxed);
            }
            self.watch_escalation(rule, &escalation, state, counters, (request.client, now));
        }
        if by_aggregate {
            counters.aggregate_excess.fetch_add(1, Ordering::Relaxed);
        }
        let shadow = !allowed && rule.shadow;
        match (allowed, shadow) {
            (true, _) => counters.passed.add(1),
            (false, true) => counters.shadow.add(1),
            (false, false) => counters.dropped.add(1),
        };
        Admission {
            allowed: allowed || shadow,
            shadow,
            rule: Some(index),
            quota: packets.map(|m| self.quota_at(rule, m, state, (now, refused_wait_ns), credits)),
            delay_ns,
            in_flight: in_flight.filter(|_| allowed),
            too_many_in_flight: false,
            refused_by,
            over_soft,
            blocked_for_ns: 0,
        }
    }

    /// [`Limiter::decide`] for a plain rule ([`is_plain`]): its one meter
    /// charged a request's one credit, what `decide` does for such a rule
    /// without asking of each feature whether the rule has it.
    /// The key's state is its request meter's cell and its last-seen
    /// cell (a [`State`]'s or a [`keys::Plain`]'s).
    #[inline(always)]
    fn decide_plain(
        &self,
        index: usize,
        rule: &Rule,
        (tat, last_seen): (&AtomicU64, &AtomicU64),
    ) -> Admission {
        let [Some(limit), ..] = rule.key_meters() else {
            unreachable!("a plain rule has a request limit")
        };
        let judged_at = Cell::new(0);
        let allowed =
            acquire(tat, &limit.gcra, self.judging_clock(&judged_at), 1) == Outcome::Allowed;
        let now = judged_at.get();
        // A plain rule's key says itself when it rests ([`rest_ns`]).
        seen(last_seen, now, true);
        let counters = &self.counters[index];
        if allowed {
            counters.passed.add(1);
        } else {
            counters.dropped.add(1);
        }
        Admission {
            allowed,
            shadow: false,
            rule: Some(index),
            // A plain rule's meters are the first alone.
            quota: Some(QuotaAt::Gcra {
                tats: [AtomicCell::load(tat), 0, 0],
                now,
                cost: 1,
                refused_wait_ns: 0,
            }),
            delay_ns: 0,
            in_flight: None,
            too_many_in_flight: false,
            refused_by: (!allowed).then_some(order::KEY_PACKETS as u8),
            over_soft: false,
            blocked_for_ns: 0,
        }
    }

    /// Escalation's look at a key, after one of its requests was judged
    /// (`limiter_common::escalation`, as the daemon's at kernel keys): over
    /// its limit when its next request would be refused.
    fn watch_escalation(
        &self,
        rule: &Rule,
        escalation: &Escalation,
        state: &State,
        counters: &HttpCounters,
        // The request's client (what the log names: a key of a header's
        // value may be a secret) and when it was judged.
        (client, now): (IpAddr, u64),
    ) {
        // The key's meters in the words of its state (none: unlimited).
        let meters = rule.key_meters();
        let over = match rule.algorithm {
            Algorithm::Gcra => meters.iter().zip(&state.cells).any(|(meter, cell)| {
                meter.is_some_and(|m| {
                    m.gcra.check(cell.load(Ordering::Acquire), now, 1) == Decision::Deny
                })
            }),
            Algorithm::SlidingLog => {
                let now = self.clock.epoch_ns();
                let mut logs = state.logs().lock().expect("log lock").clone();
                meters
                    .iter()
                    .zip(logs.iter_mut())
                    .any(|(meter, log)| meter.is_some_and(|m| !log.admit(&m.window, now, 1)))
            }
            algorithm => {
                let now = self.clock.epoch_ns();
                let windows = *state.windows().lock().expect("window lock");
                let sliding = algorithm == Algorithm::SlidingWindow;
                meters.iter().zip(&windows).any(|(meter, w)| {
                    meter.is_some_and(|m| m.window.check(w, now, 1, sliding).is_none())
                })
            }
        };
        // Over, as the daemon looks once a second: refused within the last
        // second, or refusing the next request now.
        // A key neither refused (which would have made its cold part) nor
        // over now has no watch to keep or end: not made for it.
        let cold = match state.cold.get() {
            Some(cold) => cold,
            None if !over => return,
            None => state.cold(),
        };
        let last_refused = cold.last_refused.load(Ordering::Relaxed);
        let over = over || (last_refused != 0 && now.saturating_sub(last_refused) < 1_000_000_000);
        let (since, block) = escalation.observe(cold.over_since.load(Ordering::Relaxed), over, now);
        cold.over_since.store(since, Ordering::Relaxed);
        if block {
            // Under a dry run too: its requests are then counted as
            // shadow-dropped (`excess`) and passed, until the block ends.
            counters.escalations.fetch_add(1, Ordering::Relaxed);
            let block = Duration::from_nanos(escalation.block_ns);
            tracing::warn!(
                event = "escalated",
                layer = "http",
                rule = %rule.name,
                %client,
                for_secs = block.as_secs_f64(),
                enforced = !rule.shadow,
                "a key of rule {:?} (client {client}) stayed over its limit: {} for {}",
                rule.name,
                if rule.shadow { "would be blocked (dry run)" } else { "blocked" },
                humantime::format_duration(block)
            );
            state
                .blocked_until
                .store(now.saturating_add(escalation.block_ns), Ordering::Relaxed);
        }
    }

    /// The clock a GCRA verdict reads, as each meter is judged (after the
    /// key map's lock, and again after a lost compare-and-swap), noting in
    /// `judged_at` when it last did.
    fn judging_clock<'a>(&'a self, judged_at: &'a Cell<u64>) -> impl Fn() -> u64 + Copy + 'a {
        move || {
            let now = self.clock.monotonic_ns();
            judged_at.set(now);
            now
        }
    }

    /// Charges what `charges` says with the rule's algorithm, all or
    /// none; whether allowed, and which meter refused.
    fn meter(
        &self,
        rule: &Rule,
        state: &State,
        aggregate: &State,
        charges: &Charges<'_>,
        judged_at: &Cell<u64>,
    ) -> Verdict {
        let Charges {
            rates,
            costs,
            third,
        } = *charges;
        let pair = |i: usize| usize::from(order::charges_bytes(i));
        match rule.algorithm {
            Algorithm::SlidingLog => {
                let mut key_logs = state.logs().lock().expect("log lock");
                let mut agg_logs = aggregate.logs().lock().expect("log lock");
                // Read under the locks: a wait for them does not age it.
                let now = self.clock.epoch_ns();
                // Check every log on a copy first: a refusal charges none.
                let mut trial: [Log; order::METERS] = std::array::from_fn(|i| {
                    if order::is_aggregate(i) {
                        agg_logs[pair(i)].clone()
                    } else {
                        key_logs[pair(i)].clone()
                    }
                });
                let refused = (0..order::METERS).find(|&i| {
                    !rates[i]
                        .as_ref()
                        .is_none_or(|m| trial[i].admit(&m.window, now, costs[i]))
                });
                if refused.is_none() {
                    for (i, log) in trial.into_iter().enumerate() {
                        if order::is_aggregate(i) {
                            agg_logs[pair(i)] = log;
                        } else {
                            key_logs[pair(i)] = log;
                        }
                    }
                }
                judged_at.set(self.clock.monotonic_ns());
                Verdict {
                    outcome: if refused.is_none() {
                        Outcome::Allowed
                    } else {
                        Outcome::Denied
                    },
                    refused_by: refused.unwrap_or(order::METERS),
                }
            }
            Algorithm::Gcra => {
                let charges: [Charge<'_, AtomicU64>; order::METERS] = std::array::from_fn(|i| {
                    rates[i]
                        .as_ref()
                        .map(|m| (gcra_cell(i, state, aggregate), &m.gcra, costs[i]))
                });
                let now = self.judging_clock(judged_at);
                match third {
                    // In the key's third word, charged first as in the
                    // kernel (`acquire_all_after`).
                    Some((gcra, cost)) => {
                        acquire_all_after((&state.cells[2], &gcra, cost), now, charges, now)
                    }
                    None => acquire_all(charges, now),
                }
            }
            Algorithm::FixedWindow | Algorithm::SlidingWindow => {
                let sliding = rule.algorithm == Algorithm::SlidingWindow;
                // Key first, then aggregate: the kernel's lock order.
                let mut key_windows = state.windows().lock().expect("window lock");
                let mut agg_windows = aggregate.windows().lock().expect("window lock");
                // Read under the locks: a wait for them does not age it.
                let now = self.clock.epoch_ns();
                let [k0, k1] = &mut *key_windows;
                let [a0, a1] = &mut *agg_windows;
                let mut states: [Option<&mut WindowState>; order::METERS] = Default::default();
                states[order::KEY_PACKETS] = Some(k0);
                states[order::KEY_BYTES] = Some(k1);
                states[order::AGGREGATE_PACKETS] = Some(a0);
                states[order::AGGREGATE_BYTES] = Some(a1);
                let windows = rates.map(|m| m.map(|m| m.window));
                let charges: [WindowCharge<'_>; order::METERS] = std::array::from_fn(|i| {
                    let state = states[i].take().expect("each state once");
                    windows[i].as_ref().map(|w| (state, w, costs[i]))
                });
                judged_at.set(self.clock.monotonic_ns());
                windows_all(charges, now, sliding)
            }
        }
    }

    /// A request's key under `rule`: the caller's key or the client address
    /// masked exactly as the kernel masks it, and the request's fields the
    /// rule is keyed by besides.
    #[inline]
    fn state_key(&self, index: usize, rule: &Rule, request: &RequestMeta<'_>) -> StateKey {
        // The address alone (most rules), made where it is used: the bytes
        // of a key returned from a call were written in pieces and read
        // back whole, a stall of a tenth of the check (`perf annotate`).
        if request.key.is_none()
            && let [KeyPart::Source] = rule.keyed_by.as_slice()
        {
            return StateKey::new(index, self.source_key_bytes(index, request));
        }
        StateKey::new(index, self.composite_key_bytes(index, rule, request))
    }

    /// The key of the request's source: the caller's key, or the client
    /// address masked.
    #[inline]
    fn source_key_bytes(&self, index: usize, request: &RequestMeta<'_>) -> KeyBytes {
        match request.key {
            Some(key) => KeyBytes::Custom(self.digest.of(&[key])),
            None => {
                let mask = &self.key_masks[index];
                let flow = match request.client {
                    IpAddr::V4(a) => FlowKey::v4(0, a.octets(), mask.0),
                    IpAddr::V6(a) => FlowKey::v6(0, a.octets(), mask.1),
                };
                KeyBytes::Addr(flow.addr)
            }
        }
    }

    /// [`Limiter::state_key`]'s bytes for a caller's key or several parts.
    #[inline(never)]
    fn composite_key_bytes(
        &self,
        index: usize,
        rule: &Rule,
        request: &RequestMeta<'_>,
    ) -> KeyBytes {
        let source = || self.source_key_bytes(index, request);
        if let [KeyPart::Source] = rule.keyed_by.as_slice() {
            return source();
        }
        let http = request.http.as_ref();
        let source = rule.keyed_by.contains(&KeyPart::Source).then(source);
        let source = match &source {
            Some(KeyBytes::Addr(a) | KeyBytes::Custom(a)) => Some(&a[..]),
            None => None,
        };
        let mut owned: [std::borrow::Cow<'_, [u8]>; crate::rules::request::MAX_KEY_PARTS] =
            Default::default();
        for (slot, part) in owned.iter_mut().zip(&rule.keyed_by) {
            // Matching made sure every part is there.
            *slot = match part {
                KeyPart::Source => std::borrow::Cow::Borrowed(source.unwrap_or_default()),
                other => other.of(http).unwrap_or_default(),
            };
        }
        let mut parts = [&[][..]; crate::rules::request::MAX_KEY_PARTS];
        for (slot, part) in parts.iter_mut().zip(&owned) {
            *slot = part;
        }
        KeyBytes::Custom(self.digest.of(&parts[..rule.keyed_by.len()]))
    }

    /// The rule's name in an admission (`default` for none).
    pub fn rule_name(&self, admission: &Admission) -> &str {
        admission
            .rule
            .map_or("default", |i| &self.rules.rules[i].name)
    }

    /// Quota, remaining and timing of the request meter of the key an
    /// admission judged, for the response's fields.
    pub fn quota(&self, admission: &Admission) -> Option<Quota> {
        match admission.quota? {
            QuotaAt::Ready(quota) => Some(quota),
            QuotaAt::Gcra {
                tats,
                now,
                cost,
                refused_wait_ns,
            } => {
                let rule = &self.rules.rules[admission.rule?];
                let quota = |meter: Rate, tat: u64| {
                    let g = meter.gcra;
                    let used = tat.saturating_sub(now).min(g.capacity_ns);
                    Quota {
                        quota: meter.rate,
                        window_secs: meter.period.as_secs().max(1),
                        remaining: g.remaining(tat, now),
                        reset_secs: secs(used),
                        retry_after_secs: secs(g.wait_ns(tat, now, cost)),
                    }
                };
                let first = quota(rule.packet_rate()?, tats[0]);
                let first = match rule.second_packets {
                    Some(second) => first.and(quota(second, tats[1])),
                    None => first,
                };
                // A third limit in bytes says nothing of requests.
                let mut quota = match rule.third {
                    Some(third) if !third.counts_bytes => first.and(quota(third.rate, tats[2])),
                    _ => first,
                };
                quota.retry_after_secs = quota.retry_after_secs.max(secs(refused_wait_ns));
                Some(quota)
            }
        }
    }

    /// What is left of the request meter of the key an admission judged,
    /// and the budget's whole size (the burst, or the window's limit).
    pub fn budget(&self, admission: &Admission) -> Option<(u64, u64)> {
        let quota = self.quota(admission)?;
        let rule = &self.rules.rules[admission.rule?];
        let meter = rule.packet_rate()?;
        let of = match rule.algorithm {
            Algorithm::Gcra => meter.gcra.burst,
            _ => meter.window.limit,
        };
        Some((quota.remaining, of))
    }

    /// A key's request meter as it stands, for [`Limiter::quota`].
    /// `cost`: what the request cost (its credits), for when one of that
    /// cost would conform.
    fn quota_at(
        &self,
        rule: &Rule,
        meter: &Rate,
        state: &State,
        // When the request was judged, and how long until the meter that
        // refused it (if not the key's requests) would take it.
        (monotonic, refused_wait_ns): (u64, u64),
        cost: u64,
    ) -> QuotaAt {
        match rule.algorithm {
            Algorithm::Gcra => QuotaAt::Gcra {
                tats: std::array::from_fn(|i| AtomicCell::load(&state.cells[i])),
                now: monotonic,
                cost,
                refused_wait_ns,
            },
            Algorithm::SlidingLog => {
                let now = self.clock.epoch_ns();
                let logs = state.logs().lock().expect("log lock");
                let quota = |meter: &Rate, log: &Log| {
                    let w = meter.window;
                    let reset = log
                        .oldest()
                        .map_or(0, |t| t.saturating_add(w.length_ns).saturating_sub(now));
                    Quota {
                        quota: meter.rate,
                        window_secs: meter.period.as_secs().max(1),
                        remaining: w.limit.saturating_sub(log.total()),
                        reset_secs: secs(reset),
                        retry_after_secs: if log.total().saturating_add(cost) <= w.limit {
                            0
                        } else {
                            secs(reset)
                        },
                    }
                };
                let first = quota(meter, &logs[0]);
                QuotaAt::Ready(match &rule.second_packets {
                    Some(second) => first.and(quota(second, &logs[1])),
                    None => first,
                })
            }
            Algorithm::FixedWindow | Algorithm::SlidingWindow => {
                let now = self.clock.epoch_ns();
                let windows = *state.windows().lock().expect("window lock");
                let sliding = rule.algorithm == Algorithm::SlidingWindow;
                let quota = |meter: &Rate, s: &WindowState| {
                    let w = meter.window;
                    let used = w.used(s, now, sliding);
                    let reset = w.reset_ns(s, now);
                    Quota {
                        quota: meter.rate,
                        window_secs: meter.period.as_secs().max(1),
                        remaining: w.limit.saturating_sub(used),
                        reset_secs: secs(reset),
                        retry_after_secs: if used.saturating_add(cost) <= w.limit {
                            0
                        } else {
                            secs(reset)
                        },
                    }
                };
                let first = quota(meter, &windows[0]);
                QuotaAt::Ready(match &rule.second_packets {
                    Some(second) => first.and(quota(second, &windows[1])),
                    None => first,
                })
            }
        }
    }
}

impl Quota {
    /// What a client may do under two limits at once: the first's policy,
    /// what both leave, the later of their resets and waits.
    fn and(self, other: Quota) -> Quota {
        Quota {
            remaining: self.remaining.min(other.remaining),
            reset_secs: self.reset_secs.max(other.reset_secs),
            retry_after_secs: self.retry_after_secs.max(other.retry_after_secs),
            ..self
        }
    }
}

/// Nanoseconds in whole seconds, rounded up.
fn secs(ns: u64) -> u64 {
    ns.div_ceil(1_000_000_000)
}

/// A header map of `fields`, in order (several of one name are kept).
#[cfg(test)]
pub(crate) fn test_headers(fields: &[(&str, &str)]) -> http::HeaderMap {
    let mut map = http::HeaderMap::new();
    for (name, value) in fields {
        map.append(
            http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
            value.parse().unwrap(),
        );
    }
    map
}

#[cfg(test)]
mod tests {
    use std::{
        net::{IpAddr, Ipv4Addr},
        sync::{
            Arc,
            atomic::{AtomicU64, Ordering},
        },
    };

    use super::{Clock, Limiter, RequestMeta, State, SystemClock, reason};

    fn limiter(text: &str, clock: Arc<dyn Clock>) -> Limiter {
        let rules =
            crate::rules::RuleSet::parse(text, std::path::Path::new("t.yaml")).expect("rules");
        Limiter::new(rules, clock)
    }

    /// A request known by its client's address alone.
    fn from(client: IpAddr) -> RequestMeta<'static> {
        RequestMeta {
            client,
            port: None,
            key: None,
            bytes: 0,
            http: None,
        }
    }

    /// `f` of the state of `client`'s key under the rule it comes under
    /// (made if new), a key not among the plain keys.
    fn key_state<R>(limiter: &Limiter, client: IpAddr, f: impl FnOnce(&Arc<State>) -> R) -> R {
        let request = from(client);
        let index = limiter.rule_of(&request).expect("a rule");
        let rule = &limiter.rules.rules[index];
        assert_eq!(
            limiter.plain_key(index, rule, &request),
            None,
            "a plain key"
        );
        let key = limiter.state_key(index, rule, &request);
        limiter
            .keys
            .with(key, || 0, &limiter.rest_ns, f, || panic!("no room"))
    }

    /// When `client`'s key under the rule it comes under was last seen
    /// (`None`: it has no state), wherever it is kept.
    fn last_seen(limiter: &Limiter, client: IpAddr) -> Option<u64> {
        let request = from(client);
        let index = limiter.rule_of(&request).expect("a rule");
        let rule = &limiter.rules.rules[index];
        let seen = |cell: &AtomicU64| cell.load(Ordering::Relaxed);
        match limiter.plain_key(index, rule, &request) {
            Some(key) => limiter.keys.plain.get(key, |p| seen(&p.last_seen)),
            None => {
                let key = limiter.state_key(index, rule, &request);
                limiter.keys.get(&key, |state| seen(&state.last_seen))
            }
        }
    }

    /// A key of a GCRA rule (most keys) costs its state's words and a
    /// pointer to what only some rules use: with the `Arc`'s two counts,
    /// one cache line. What escalation and in-flight counting add is 32
    /// bytes; the window and log counts, only their algorithms' keys make.
    #[test]
    fn a_key_state_and_its_counts_fill_one_cache_line() {
        assert_eq!(std::mem::size_of::<State>(), 6 * 8);
        let layout = std::alloc::Layout::for_value(&*Arc::new(State::default()));
        assert_eq!(layout.size() + 2 * std::mem::size_of::<usize>(), 64);
        assert_eq!(std::mem::size_of::<super::Cold>(), 4 * 8);
    }

    /// A clock the test sets.
    struct Ticks(AtomicU64);

    impl Clock for Ticks {
        fn monotonic_ns(&self) -> u64 {
            self.0.load(Ordering::Relaxed)
        }

        fn epoch_ns(&self) -> u64 {
            self.monotonic_ns()
        }
    }

    /// A plain rule's shortcut decides as the whole decision does: the
    /// same verdicts and fields, at random times and clients (IPv4 ones
    /// among the plain keys, IPv6 ones not), the same counts, the same
    /// last-seen of every key.
    #[test]
    fn a_plain_rule_is_judged_as_the_whole_decision_would() {
        let text = "rules:\n  - { name: fast, match: { source: 10.0.0.0/8 }, limit: { rate: 5, unit: second, burst: 3 } }\n  - { name: fast6, match: { source: 2001:db8::/32 }, limit: { rate: 5, unit: second, burst: 3 } }\n  - { name: slow, limit: { rate: 100, unit: minute } }\n";
        let clock = Arc::new(Ticks(1_000_000_000.into()));
        let (shortcut, mut whole) = (limiter(text, clock.clone()), limiter(text, clock.clone()));
        assert!(shortcut.plain.iter().all(Option::is_some));
        whole.plain.fill(None);
        let clients: [IpAddr; 5] = [
            Ipv4Addr::new(10, 0, 0, 1).into(),
            Ipv4Addr::new(10, 0, 0, 2).into(),
            Ipv4Addr::new(192, 0, 2, 1).into(),
            "2001:db8::1".parse().expect("an address"),
            "2001:db9::1".parse().expect("an address"),
        ];
        // By rule: requests refused, passed.
        let (mut seed, mut outcomes) = (7u64, [[0u32; 2]; 3]);
        for _ in 0..2_000 {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            clock
                .0
                .fetch_add((seed >> 33) % 100_000_000, Ordering::Relaxed);
            let request = from(clients[(seed >> 20) as usize % clients.len()]);
            let admission = shortcut.check(&request);
            assert_eq!(admission, whole.check(&request));
            let rule = admission.rule.expect("a rule applies");
            outcomes[rule][usize::from(admission.allowed)] += 1;
        }
        assert!(outcomes.iter().flatten().all(|&n| n > 30), "{outcomes:?}");
        for (a, b) in shortcut.counters.iter().zip(&whole.counters) {
            assert_eq!(
                [a.passed.get(), a.dropped.get(), a.shadow.get()],
                [b.passed.get(), b.dropped.get(), b.shadow.get()]
            );
        }
        for client in clients {
            let seen = last_seen(&shortcut, client);
            assert!(seen.is_some(), "{client} has no state");
            assert_eq!(seen, last_seen(&whole, client), "{client}");
        }
        // The IPv4 clients' keys are the plain ones.
        assert_eq!(shortcut.keys.plain.len(), 3);
        assert_eq!(whole.keys.plain.len(), 0);
        assert_eq!(shortcut.tracked_keys(), 5);
    }

    /// A rule with anything besides one GCRA request limit is not plain:
    /// the shortcut would skip it.
    #[test]
    fn a_rule_with_more_than_one_request_limit_is_not_plain() {
        let limit = "limit: { rate: 10, unit: second, burst: 5 }";
        let rule = |rest: &str| {
            let text = format!("rules:\n  - {{ name: r, {rest} }}\n");
            let rules = crate::rules::RuleSet::parse(&text, std::path::Path::new("t.yaml"))
                .unwrap_or_else(|e| panic!("{rest}: {e}"));
            super::is_plain(&rules.rules[0])
        };
        assert!(rule(limit), "{limit}");
        for rest in [
            "limit: unlimited".to_owned(),
            "limit: { bytes: 1000, unit: second, burst_bytes: 1000 }".to_owned(),
            "limits: [{ rate: 10, unit: second, burst: 5 }, { rate: 100, unit: minute }]".to_owned(),
            "limits: [{ rate: 10, unit: second, burst: 5 }, { bytes: 1000, unit: second, burst_bytes: 1000 }]".to_owned(),
            "limits: [{ rate: 10, unit: second, burst: 5 }, { rate: 100, unit: minute }, { rate: 1000, unit: hour }]".to_owned(),
            "limit: { rate: 10, unit: second }, algorithm: fixed_window".to_owned(),
            "limit: { rate: 10, unit: second, burst: 5, delay: 100ms }".to_owned(),
            format!("{limit}, soft: {{ rate: 5, unit: second, burst: 2 }}"),
            format!("{limit}, escalate: {{ after: 1s, block: 2s }}"),
            format!("{limit}, action: shadow"),
            format!("{limit}, concurrent: 4"),
            format!("{limit}, aggregate: {{ rate: 100, unit: second, burst: 10 }}"),
            format!("{limit}, cost: [{{ match: {{ method: POST }}, credits: 5 }}]"),
        ] {
            assert!(!rule(&rest), "{rest} was taken for plain");
        }
    }

    /// What only some rules use is made only for their keys, and for an
    /// escalation rule's only once the key is over its limit: a plain
    /// GCRA key, or one within its limit, stays one cache line.
    #[test]
    fn a_key_makes_its_cold_part_only_when_its_rule_needs_it() {
        // An IPv6 client's key of a plain rule: one not among the plain
        // keys (which have no cold part at all).
        let text = "rules:\n  - { name: plain, match: { source: 2001:db8::/32 }, limit: { rate: 2, unit: second, burst: 2 } }\n  - { name: watched, limit: { rate: 2, unit: second, burst: 2 }, escalate: { after: 1s, block: 2s } }\n";
        let limiter = limiter(text, Arc::new(SystemClock));
        let (plain, watched) = (
            "2001:db8::1".parse().expect("an address"),
            IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1)),
        );
        let cold_made =
            |client: IpAddr| key_state(&limiter, client, |state| state.cold.get().is_some());
        // One request of a burst of two: neither key is over its limit.
        for client in [plain, watched] {
            assert!(limiter.check(&from(client)).allowed);
        }
        assert!(!cold_made(plain) && !cold_made(watched));
        // Over it (the third in a burst of two is refused): the watched
        // key keeps a watch, the plain one still nothing.
        for client in [plain, watched, plain, watched] {
            limiter.check(&from(client));
        }
        assert!(!cold_made(plain), "a plain GCRA key made its cold part");
        assert!(cold_made(watched), "escalation's watch was not kept");
    }

    /// Requests `client` gets through at once.
    fn admitted_at_once(limiter: &Limiter, client: IpAddr) -> u32 {
        let mut n = 0;
        while limiter.check(&from(client)).allowed {
            n += 1;
            assert!(n < 1_000, "never refused");
        }
        n
    }

    /// A reload that makes a rule plain, or makes it something else, keeps
    /// each key's debt, wherever its keys are kept on either side, carried
    /// to new limits (half a burst spent is half of the new one); one that
    /// drops a rule forgets its plain keys. By `Limiter::reloaded` and by
    /// `Reloadable::reload` (the swap, its second pass, its settling).
    #[test]
    fn a_reload_keeps_a_keys_debt_as_its_rule_becomes_plain_or_stops_being() {
        for swapped in [false, true] {
            reload_steps(swapped);
        }
    }

    fn reload_steps(swapped: bool) {
        let rule = |burst: u32, rest: &str| {
            format!("{{ name: api, limit: {{ rate: 1, unit: minute, burst: {burst} }}{rest} }}")
        };
        let rule_file = |rule: &str| {
            crate::rules::RuleSet::parse(
                &format!("rules:\n  - {rule}\n"),
                std::path::Path::new("t.yaml"),
            )
            .expect("rules")
        };
        let clock = Arc::new(Ticks(1_000_000_000.into()));
        let first = limiter(&format!("rules:\n  - {}\n", rule(4, "")), clock.clone());
        let reloadable = super::Reloadable::new(Arc::new(first));
        let mut limiter = reloadable.current();
        let spend = |limiter: &Limiter, client: IpAddr, n: u32| {
            for _ in 0..n {
                assert!(limiter.check(&from(client)).allowed, "{client}");
            }
        };
        // Clients spent whole before the first reload stay so throughout.
        let spent: [IpAddr; 2] = [
            Ipv4Addr::new(198, 18, 1, 1).into(),
            "2001:db8:1::1".parse().expect("an address"),
        ];
        for client in spent {
            spend(&limiter, client, 4);
        }
        // (rule, plain after, burst before -> after)
        let soft = ", soft: { rate: 1, unit: hour }";
        let escalate = ", escalate: { after: 1m, block: 1m }";
        let steps = [
            (rule(8, soft), false, 4, 8),
            (rule(4, ""), true, 8, 4),
            (rule(8, ""), true, 4, 8),
            (rule(4, escalate), false, 8, 4),
            (rule(4, ""), true, 4, 4),
            (rule(4, ""), true, 4, 4),
        ];
        for (n, (rule, plain, before, after)) in steps.into_iter().enumerate() {
            let what = format!("step {n} ({rule}), swapped: {swapped}");
            // Two clients spend half their burst under the rule before.
            let half: [IpAddr; 2] = [
                Ipv4Addr::new(198, 18, 2, n as u8).into(),
                format!("2001:db8:2:{n}::1").parse().expect("an address"),
            ];
            for client in half {
                spend(&limiter, client, before / 2);
            }
            let next = if swapped {
                assert_eq!(reloadable.reload(rule_file(&rule)), 1, "{what}");
                reloadable.settle();
                reloadable.current()
            } else {
                let (next, kept) = limiter.reloaded(rule_file(&rule));
                assert_eq!(kept, 1, "{what}");
                Arc::new(next)
            };
            assert_eq!(next.plain[0].is_some(), plain, "{what}");
            for client in half {
                assert_eq!(
                    admitted_at_once(&next, client),
                    after / 2,
                    "{client}: {what}"
                );
            }
            for client in spent {
                assert_eq!(admitted_at_once(&next, client), 0, "{client}: {what}");
            }
            // Every client kept, each in the store its rule keeps it in.
            let ipv4_keys = n + 2;
            assert_eq!(next.tracked_keys(), 2 * ipv4_keys, "{what}");
            assert_eq!(
                next.keys.plain.len(),
                usize::from(plain) * ipv4_keys,
                "{what}"
            );
            limiter = next;
        }
        // The debt is the limit's own: a request's worth a minute.
        clock.0.fetch_add(60_000_000_000, Ordering::Relaxed);
        for client in spent {
            assert_eq!(admitted_at_once(&limiter, client), 1, "{client}");
        }
        let other =
            "{ name: other, match: { source: 10.0.0.0/8 }, limit: { rate: 5, unit: second } }";
        let next = if swapped {
            assert_eq!(reloadable.reload(rule_file(other)), 0);
            reloadable.settle();
            reloadable.current()
        } else {
            Arc::new(limiter.reloaded(rule_file(other)).0)
        };
        assert_eq!(next.tracked_keys(), 0);
        assert_eq!(next.keys.plain.len(), 0);
    }

    /// `max_keys` bounds the plain keys and the others together: past it,
    /// keys in debt in either are kept and a new key refused; once they
    /// rest, the least recently seen of both go first.
    #[test]
    fn max_keys_bounds_the_plain_keys_and_the_others_together() {
        let text =
            "max_keys: 4\nrules:\n  - { name: api, limit: { rate: 1, unit: minute, burst: 1 } }\n";
        let clock = Arc::new(Ticks(1_000_000_000.into()));
        let limiter = limiter(text, clock.clone());
        let clients: [IpAddr; 5] = [
            Ipv4Addr::new(198, 18, 0, 1).into(),
            // Keys by /64 (the default).
            "2001:db8:0:1::1".parse().expect("an address"),
            Ipv4Addr::new(198, 18, 0, 2).into(),
            "2001:db8:0:2::1".parse().expect("an address"),
            Ipv4Addr::new(198, 18, 0, 3).into(),
        ];
        // Seen in this order, each a few milliseconds after the last.
        for &client in &clients[..4] {
            clock.0.fetch_add(5_000_000, Ordering::Relaxed);
            assert!(limiter.check(&from(client)).allowed, "{client}");
        }
        assert_eq!((limiter.keys.plain.len(), limiter.tracked_keys()), (2, 4));
        let refused = limiter.check(&from(clients[4]));
        assert!(!refused.allowed);
        assert_eq!(refused.refused_by, Some(reason::NO_SLOT));
        // All at rest a minute on: room is made down to half, the two
        // seen first (one of each kind) forgotten.
        clock.0.fetch_add(60_000_000_000, Ordering::Relaxed);
        assert!(limiter.check(&from(clients[4])).allowed);
        let kept = clients.map(|c| last_seen(&limiter, c).is_some());
        assert_eq!(kept, [false, false, true, true, true]);
        assert_eq!(limiter.tracked_keys(), 3);
    }

    /// A key its escalation blocked stays blocked when a reload makes its
    /// rule plain: its block is kept where it is (not among the plain
    /// keys), and found there.
    #[test]
    fn an_escalation_block_outlasts_a_reload_that_makes_its_rule_plain() {
        let limit = "limit: { rate: 1, unit: minute, burst: 1 }";
        let clock = Arc::new(Ticks(1_000_000_000.into()));
        let text =
            format!("rules:\n  - {{ name: api, {limit}, escalate: {{ after: 1s, block: 5m }} }}\n");
        let limiter = limiter(&text, clock.clone());
        let client: IpAddr = Ipv4Addr::new(198, 18, 0, 1).into();
        let at = |ms: u64| {
            clock
                .0
                .store(1_000_000_000 + ms * 1_000_000, Ordering::Relaxed);
            limiter.check(&from(client))
        };
        assert!(at(0).allowed);
        // Over its limit at every request for longer than a second.
        for ms in [10, 600, 1_200, 1_800] {
            assert!(!at(ms).allowed);
        }
        assert!(at(2_000).blocked_for_ns > 0, "never blocked");
        let rules = crate::rules::RuleSet::parse(
            &format!("rules:\n  - {{ name: api, {limit} }}\n"),
            std::path::Path::new("t.yaml"),
        )
        .expect("rules");
        let (next, kept) = limiter.reloaded(rules);
        assert_eq!((kept, next.plain[0].is_some()), (1, true));
        assert_eq!(next.keys.plain.len(), 0);
        let at = |s: u64| {
            clock
                .0
                .store(1_000_000_000 + s * 1_000_000_000, Ordering::Relaxed);
            next.check(&from(client))
        };
        // Its debt alone would be paid in a minute: the block holds.
        let blocked = at(120);
        assert!(!blocked.allowed && blocked.blocked_for_ns > 0);
        assert!(at(310).allowed, "blocked past its block");
    }
}
