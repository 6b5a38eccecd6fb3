//! Layer 7: the same rule file and the same `limiter-common` functions as
//! the kernel, applied to requests. A rule matches a request by its client
//! address (TCP, the service's port), keys it by the same masked address as
//! the kernel (or by a header, or any key the caller extracts), and meters
//! it with the same GCRA or window code: one request costs 1 against
//! packet (`rate`) limits, and its size against byte (`bytes`) limits.

pub mod headers;
pub mod layer;

use std::{
    collections::HashMap,
    net::IpAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
};

use limiter_common::{
    abi::FlowKey,
    gcra::Gcra,
    log::Log,
    meter::{AtomicCell, Outcome, acquire_all, acquire_delayed, windows_all},
    window::{Window, WindowState},
};
use serde::Serialize;

pub use layer::{ClientAddr, CostBy, KeyBy, RateLimit, RateLimitLayer};

use crate::{
    config::{Algorithm, Limit, Meter, Meters, Rule, RuleSet, Verdict},
    tables,
};

/// Where the limiter reads the time: monotonic ns for GCRA, Unix-epoch ns
/// for windows (aligned to the epoch, as envoy's). Tests drive their own.
pub trait Clock: Send + Sync {
    fn monotonic_ns(&self) -> u64;
    fn epoch_ns(&self) -> u64;
}

/// The system's clocks.
pub struct SystemClock;

impl Clock for SystemClock {
    fn monotonic_ns(&self) -> u64 {
        crate::engine::monotonic_ns()
    }

    fn epoch_ns(&self) -> u64 {
        crate::engine::realtime_ns()
    }
}

/// One request as the limiter sees it.
#[derive(Clone, Copy, Debug)]
pub struct Request<'a> {
    pub client: IpAddr,
    /// The service's port, for rules that name `dest_port`.
    pub port: Option<u16>,
    /// A key to use instead of the client's address (e.g. an API token).
    pub key: Option<&'a [u8]>,
    /// Cost against byte limits.
    pub bytes: u64,
}

/// What to tell the client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    /// Forward the request.
    pub allowed: bool,
    /// Excess let through by a dry run.
    pub shadow: bool,
    /// The rule that applied (`None`: the default).
    pub rule: Option<Arc<str>>,
    /// The rule's packet (request) limit: quota and window, for headers.
    pub policy: Option<Policy>,
    /// Pacing: hold the request this long before forwarding it.
    pub delay_ns: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Policy {
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
pub struct RuleCounters {
    pub passed: AtomicU64,
    pub dropped: AtomicU64,
    pub shadow: AtomicU64,
}

/// State of one key (or of a rule's aggregate): GCRA cells and windows for
/// the request meter (0) and the byte meter (1).
#[derive(Default)]
struct State {
    cells: [AtomicU64; 2],
    windows: Mutex<[WindowState; 2]>,
    logs: Mutex<[Log; 2]>,
    /// When the key was last seen (monotonic ns), for eviction.
    last_seen: AtomicU64,
}

/// Bounds memory as the kernel's LRU map does: past `max_keys` keys, the
/// least recently seen are forgotten (and start again with a full budget).
fn evict_least_recent(keys: &mut HashMap<StateKey, Arc<State>>, keep: usize) {
    let mut seen: Vec<u64> = keys
        .values()
        .map(|s| s.last_seen.load(Ordering::Relaxed))
        .collect();
    let cut = seen.len().saturating_sub(keep);
    if cut == 0 {
        return;
    }
    let (_, threshold, _) = seen.select_nth_unstable(cut - 1);
    let threshold = *threshold;
    keys.retain(|_, s| s.last_seen.load(Ordering::Relaxed) > threshold);
}

/// A key's identity: the rule's index and either the masked client address
/// (no allocation) or the caller's key bytes.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum KeyBytes {
    Addr([u8; 16]),
    Custom(Box<[u8]>),
}

type StateKey = (usize, KeyBytes);

pub struct Limiter {
    rules: RuleSet,
    /// Rules most specific first, as the kernel searches them.
    order: Vec<usize>,
    names: Vec<Arc<str>>,
    clock: Arc<dyn Clock>,
    /// By (rule index, key).
    keys: Mutex<HashMap<StateKey, Arc<State>>>,
    aggregates: Vec<State>,
    pub counters: Vec<RuleCounters>,
}

impl Limiter {
    pub fn new(rules: RuleSet, clock: Arc<dyn Clock>) -> Self {
        let n = rules.rules.len();
        Self {
            aggregates: (0..n).map(|_| State::default()).collect(),
            counters: (0..n).map(|_| RuleCounters::default()).collect(),
            order: tables::match_order(&rules),
            names: rules
                .rules
                .iter()
                .map(|r| Arc::from(r.name.as_str()))
                .collect(),
            rules,
            clock,
            keys: Mutex::new(HashMap::new()),
        }
    }

    pub fn rules(&self) -> &RuleSet {
        &self.rules
    }

    /// Keys with state now.
    pub fn tracked_keys(&self) -> usize {
        self.keys.lock().expect("key map lock").len()
    }

    /// Meters one request and decides.
    pub fn check(&self, request: &Request<'_>) -> Decision {
        let Some(index) =
            tables::first_match(&self.rules, &self.order, request.client, 6, request.port)
        else {
            let allowed = self.rules.default == Verdict::Pass;
            return Decision {
                allowed,
                shadow: false,
                rule: None,
                policy: None,
                delay_ns: 0,
            };
        };
        let rule = &self.rules.rules[index];
        let Limit::Metered { packets, bytes } = rule.limit else {
            return Decision {
                allowed: true,
                shadow: false,
                rule: Some(Arc::clone(&self.names[index])),
                policy: None,
                delay_ns: 0,
            };
        };
        let monotonic = self.clock.monotonic_ns();
        let state = self.state(index, rule, request, monotonic);
        let aggregate = &self.aggregates[index];
        let none = Meters {
            packets: None,
            bytes: None,
        };
        let agg = rule.aggregate.unwrap_or(none);
        let costs = [1, request.bytes];
        let meters = [packets, bytes, agg.packets, agg.bytes];
        let mut delay_ns = 0;
        let allowed = match rule.algorithm {
            Algorithm::Gcra if rule.delay.is_some() => {
                // Validation allows pacing only on a lone packet meter.
                let max =
                    u64::try_from(rule.delay.unwrap_or_default().as_nanos()).unwrap_or(u64::MAX);
                let gcra = packets.as_ref().map(|m| m.gcra).unwrap_or_default();
                let now = self.clock.monotonic_ns();
                match acquire_delayed(&state.cells[0], &gcra, now, 1, max) {
                    Some(wait) => {
                        delay_ns = wait;
                        true
                    }
                    None => false,
                }
            }
            Algorithm::SlidingLog => {
                let now = self.clock.epoch_ns();
                let mut key_logs = state.logs.lock().expect("log lock");
                let mut agg_logs = aggregate.logs.lock().expect("log lock");
                // Check every log on a copy first: a refusal charges none.
                let mut trial = [
                    key_logs[0].clone(),
                    key_logs[1].clone(),
                    agg_logs[0].clone(),
                    agg_logs[1].clone(),
                ];
                let ok = meters
                    .iter()
                    .zip(&mut trial)
                    .enumerate()
                    .all(|(i, (m, log))| {
                        m.as_ref()
                            .is_none_or(|m| log.admit(&m.window, now, costs[i % 2]))
                    });
                if ok {
                    let [k0, k1, a0, a1] = trial;
                    *key_logs = [k0, k1];
                    *agg_logs = [a0, a1];
                }
                ok
            }
            Algorithm::Gcra => {
                let now = monotonic;
                fn charge<'a>(
                    m: &'a Option<Meter>,
                    s: &'a State,
                    i: usize,
                    cost: u64,
                ) -> Option<(&'a AtomicU64, &'a Gcra, u64)> {
                    m.as_ref().map(|m| (&s.cells[i], &m.gcra, cost))
                }
                let charges: [Option<(&AtomicU64, &Gcra, u64)>; 4] = [
                    charge(&meters[0], &state, 0, costs[0]),
                    charge(&meters[1], &state, 1, costs[1]),
                    charge(&meters[2], aggregate, 0, costs[0]),
                    charge(&meters[3], aggregate, 1, costs[1]),
                ];
                acquire_all(charges, now).outcome == Outcome::Allowed
            }
            Algorithm::FixedWindow | Algorithm::SlidingWindow => {
                let now = self.clock.epoch_ns();
                let sliding = rule.algorithm == Algorithm::SlidingWindow;
                // Key first, then aggregate: the kernel's lock order.
                let mut key_windows = state.windows.lock().expect("window lock");
                let mut agg_windows = aggregate.windows.lock().expect("window lock");
                let [k0, k1] = &mut *key_windows;
                let [a0, a1] = &mut *agg_windows;
                let window = |m: &Option<Meter>| m.as_ref().map(|m| m.window);
                let (w0, w1, w2, w3) = (
                    window(&meters[0]),
                    window(&meters[1]),
                    window(&meters[2]),
                    window(&meters[3]),
                );
                let charges: [Option<(&mut WindowState, &Window, u64)>; 4] = [
                    w0.as_ref().map(|w| (k0, w, costs[0])),
                    w1.as_ref().map(|w| (k1, w, costs[1])),
                    w2.as_ref().map(|w| (a0, w, costs[0])),
                    w3.as_ref().map(|w| (a1, w, costs[1])),
                ];
                windows_all(charges, now, sliding).outcome == Outcome::Allowed
            }
        };
        let counters = &self.counters[index];
        let shadow = !allowed && rule.shadow;
        match (allowed, shadow) {
            (true, _) => counters.passed.fetch_add(1, Ordering::Relaxed),
            (false, true) => counters.shadow.fetch_add(1, Ordering::Relaxed),
            (false, false) => counters.dropped.fetch_add(1, Ordering::Relaxed),
        };
        Decision {
            allowed: allowed || shadow,
            shadow,
            rule: Some(Arc::clone(&self.names[index])),
            policy: packets.map(|m| self.policy(rule, &m, &state, monotonic)),
            delay_ns,
        }
    }

    /// The key's state, created on first sight. Keys are the rule's index
    /// and either the caller's key or the client address masked exactly as
    /// the kernel masks it.
    fn state(&self, index: usize, rule: &Rule, request: &Request<'_>, now: u64) -> Arc<State> {
        let key = match request.key {
            Some(key) => KeyBytes::Custom(key.into()),
            None => {
                let mask = crate::tables::key_masks(rule);
                let flow = match request.client {
                    IpAddr::V4(a) => FlowKey::v4(0, a.octets(), mask.0),
                    IpAddr::V6(a) => FlowKey::v6(0, a.octets(), mask.1),
                };
                KeyBytes::Addr(flow.addr)
            }
        };
        let mut keys = self.keys.lock().expect("key map lock");
        let state = Arc::clone(keys.entry((index, key)).or_default());
        state.last_seen.store(now, Ordering::Relaxed);
        let capacity = self.rules.max_keys as usize;
        if keys.len() > capacity {
            evict_least_recent(&mut keys, capacity / 2);
        }
        state
    }

    /// Quota, remaining and timing of a key's request meter, for headers.
    fn policy(&self, rule: &Rule, meter: &Meter, state: &State, monotonic: u64) -> Policy {
        let window_secs = meter.period.as_secs().max(1);
        let secs = |ns: u64| ns.div_ceil(1_000_000_000);
        match rule.algorithm {
            Algorithm::Gcra => {
                let now = monotonic;
                let tat = AtomicCell::load(&state.cells[0]);
                let g = meter.gcra;
                let used = tat.saturating_sub(now).min(g.capacity_ns);
                Policy {
                    quota: meter.rate,
                    window_secs,
                    remaining: (g.capacity_ns - used) / g.emission_ns,
                    reset_secs: secs(used),
                    retry_after_secs: secs(g.wait_ns(tat, now, 1)),
                }
            }
            Algorithm::SlidingLog => {
                let now = self.clock.epoch_ns();
                let log = &state.logs.lock().expect("log lock")[0];
                let w = meter.window;
                let reset = log
                    .oldest()
                    .map_or(0, |t| t.saturating_add(w.length_ns).saturating_sub(now));
                Policy {
                    quota: meter.rate,
                    window_secs,
                    remaining: w.limit.saturating_sub(log.total()),
                    reset_secs: secs(reset),
                    retry_after_secs: if log.total() < w.limit {
                        0
                    } else {
                        secs(reset)
                    },
                }
            }
            Algorithm::FixedWindow | Algorithm::SlidingWindow => {
                let now = self.clock.epoch_ns();
                let w = meter.window;
                let s = state.windows.lock().expect("window lock")[0];
                let used = if rule.algorithm == Algorithm::FixedWindow {
                    s.current
                } else {
                    // The weighted estimate, rounded up.
                    let elapsed = now.saturating_sub(s.start).min(w.length_ns);
                    let weighted = u128::from(s.previous) * u128::from(w.length_ns - elapsed);
                    s.current + weighted.div_ceil(u128::from(w.length_ns)) as u64
                };
                let reset = w.reset_ns(&s, now);
                Policy {
                    quota: meter.rate,
                    window_secs,
                    remaining: w.limit.saturating_sub(used),
                    reset_secs: secs(reset),
                    retry_after_secs: if used < w.limit { 0 } else { secs(reset) },
                }
            }
        }
    }
}
