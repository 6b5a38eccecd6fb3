//! Tracing the kernel's decisions: the filter written to the pinned
//! `TRACE` map, the decisions read from the `TRACE_EVENTS` ring buffer
//! and turned into [`TraceLine`]s. The same for the daemon's state and
//! for `limiter run`'s: both pin their maps. One tracer at a time (a lock
//! beside the pin directory's); a tracer that dies without stopping is
//! found by [`stop_abandoned`], which the daemon and `limiter run` call
//! every few seconds.

use std::{
    collections::HashMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::fd::{AsRawFd, RawFd},
    path::Path,
};

use anyhow::{Context, Result, bail};
use aya::maps::{Array, Map, MapData, PerCpuArray, RingBuf};
use limiter_common::{
    abi::{GlobalConfig, MAX_RULES, NO_PORT, RuleConfig, map_name, rule_flag, rule_slot},
    gcra::Gcra,
    meter::order,
    trace::{TraceConfig, TraceEvent, verdict},
};

use super::{maps::pinned_data, pins::PinLock};
use crate::trace::{
    TraceFilter, TraceLine, kernel_budgets, meter_name, protocol_name, refused_by, time_of,
};

/// A running trace of the limiter pinned at a directory; tracing stops
/// when it is dropped.
pub struct KernelTracer {
    config: Array<MapData, TraceConfig>,
    events: RingBuf<MapData>,
    counts: PerCpuArray<MapData, [u64; 2]>,
    rules: Array<MapData, RuleConfig>,
    /// The meters of keys' third words (`SOFT_LIMITS`): a third limit's.
    third_words: Option<Array<MapData, Gcra>>,
    global: Array<MapData, GlobalConfig>,
    /// Traced and lost (ring full) before this trace began.
    counts_at_start: [u64; 2],
    /// Rule configs by id in the active generation, read once each;
    /// emptied when the generation flips (a rule set was applied).
    rule_cache: HashMap<u32, (RuleConfig, Option<Gcra>)>,
    /// The generation the cache (and the `--rule` id) is of.
    cached_generation: u32,
    /// The filter as asked (its rule by name, found again after a flip).
    filter: TraceFilter,
    ifindex: u32,
    /// `CLOCK_REALTIME − CLOCK_MONOTONIC`, read at the start.
    realtime_offset_ns: u64,
    _lock: PinLock,
}

impl KernelTracer {
    /// Starts tracing what `filter` selects.
    pub fn start(pin_dir: &Path, filter: &TraceFilter) -> Result<Self> {
        if !pin_dir.join(map_name::CONFIG).exists() {
            return Err(super::KernelError::NotRunning {
                dir: pin_dir.to_owned(),
            }
            .into());
        }
        if !pin_dir.join(map_name::TRACE).exists() {
            bail!(
                "the limiter at {} was started by a build without tracing; restart it with this one",
                pin_dir.display()
            );
        }
        let lock = PinLock::trace(pin_dir)?;
        let open = |name: &str| -> Result<Map> {
            Map::from_map_data(pinned_data(pin_dir, name)?).with_context(|| format!("map {name}"))
        };
        let config: Array<MapData, TraceConfig> = open(map_name::TRACE)?.try_into()?;
        let events: RingBuf<MapData> = open(map_name::TRACE_EVENTS)?.try_into()?;
        let counts: PerCpuArray<MapData, [u64; 2]> = open(map_name::TRACE_COUNTS)?.try_into()?;
        let rules: Array<MapData, RuleConfig> = open(map_name::RULES)?.try_into()?;
        let third_words = open(map_name::SOFT_LIMITS)
            .ok()
            .and_then(|m| Array::try_from(m).ok());
        let global: Array<MapData, GlobalConfig> = open(map_name::CONFIG)?.try_into()?;
        let generation = global.get(&0, 0)?.generation;
        let rule = match &filter.rule {
            Some(name) => Some(rule_id(&rules, generation, name)?),
            None => None,
        };
        let ifindex = match &filter.iface {
            Some(name) => super::if_index(name)?,
            None => 0,
        };
        let wanted = filter.config(rule, ifindex)?;
        let mut tracer = Self {
            cached_generation: generation,
            filter: filter.clone(),
            ifindex,
            counts_at_start: sum(&counts)?,
            config,
            events,
            counts,
            rules,
            third_words,
            global,
            rule_cache: HashMap::new(),
            realtime_offset_ns: crate::clock::realtime_offset_ns(),
            _lock: lock,
        };
        // What an earlier tracer left in the ring is not this trace's.
        while tracer.events.next().is_some() {}
        tracer
            .config
            .set(0, wanted, 0)
            .context("starting the trace")?;
        Ok(tracer)
    }

    /// The next decision traced, if one is waiting.
    pub fn next_line(&mut self) -> Option<TraceLine> {
        let event = {
            let item = self.events.next()?;
            let mut event = TraceEvent::default();
            let n = item.len().min(size_of::<TraceEvent>());
            // SAFETY: TraceEvent is plain data (repr(C), every bit pattern
            // valid); at most its size is copied into it.
            unsafe {
                std::ptr::copy_nonoverlapping(item.as_ptr(), (&raw mut event).cast::<u8>(), n);
            }
            event
        };
        Some(self.line(&event))
    }

    /// Waits up to `timeout` for decisions to read; whether some wait.
    pub fn wait(&self, timeout: std::time::Duration) -> Result<bool> {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        use std::os::fd::AsFd;
        let mut fds = [PollFd::new(self.events.as_fd(), PollFlags::POLLIN)];
        let timeout = PollTimeout::try_from(timeout).unwrap_or(PollTimeout::MAX);
        match poll(&mut fds, timeout) {
            Ok(n) => Ok(n > 0),
            Err(nix::errno::Errno::EINTR) => Ok(false),
            Err(e) => Err(e).context("waiting for traced decisions"),
        }
    }

    /// Decisions this trace sent, and those lost because the ring was full
    /// (the tracer did not keep up: sample more sparsely).
    pub fn counts(&self) -> Result<[u64; 2]> {
        let now = sum(&self.counts)?;
        Ok([
            now[0].saturating_sub(self.counts_at_start[0]),
            now[1].saturating_sub(self.counts_at_start[1]),
        ])
    }

    fn line(&mut self, event: &TraceEvent) -> TraceLine {
        let (rule, third) = match self.rule(event.generation, event.rule) {
            Some((rule, third)) => (Some(rule), third),
            None => (None, None),
        };
        let rule_name = match (&rule, event.verdict) {
            (_, verdict::MALFORMED) => "-".to_owned(),
            (Some(rule), _) => String::from_utf8_lossy(rule.name()).into_owned(),
            (None, _) => format!("#{}", event.rule),
        };
        let left = match (&rule, event.verdict) {
            (Some(rule), verdict::PASSED | verdict::DROPPED | verdict::SHADOW) => {
                kernel_budgets(rule, third.as_ref(), event, self.realtime_offset_ns)
            }
            _ => Vec::new(),
        };
        TraceLine {
            time: time_of(event.time_ns.wrapping_add(self.realtime_offset_ns)),
            layer: "xdp".into(),
            interface: super::counters::iface_name(event.ifindex),
            source: source(event),
            protocol: if event.family == 0 {
                "-".into()
            } else {
                protocol_name(event.protocol)
            },
            port: (event.dest_port != NO_PORT && event.family != 0 && event.dest_port <= 0xffff)
                .then_some(event.dest_port as u16)
                .filter(|_| matches!(event.protocol, 6 | 17 | 132)),
            rule: rule_name,
            verdict: verdict::name(event.verdict).into(),
            refused_by: match &rule {
                Some(rule)
                    if usize::from(event.reason) < order::METERS
                        || usize::from(event.reason) == order::KEY_THIRD =>
                {
                    Some(meter_name(rule, event.reason).to_owned())
                }
                _ => refused_by(event.reason),
            },
            left,
            bytes: u64::from(event.len),
            request: None,
        }
    }

    /// A rule's config, and its third limit's meter if it has one.
    fn rule(&mut self, generation: u32, id: u32) -> Option<(RuleConfig, Option<Gcra>)> {
        let active = self.global.get(&0, 0).ok()?.generation;
        if active != self.cached_generation {
            // A rule set was applied: its rules, and maybe another id for
            // the rule traced by name.
            self.rule_cache.clear();
            self.cached_generation = active;
            if let Some(name) = &self.filter.rule {
                // Gone from the new rules: an id no rule has, so nothing
                // is traced (rather than whichever rule took its id).
                let id = rule_id(&self.rules, active, name).unwrap_or(MAX_RULES);
                if let Ok(config) = self.filter.config(Some(id), self.ifindex) {
                    let _ = self.config.set(0, config, 0);
                }
            }
        }
        if generation == active
            && let Some(rule) = self.rule_cache.get(&id)
        {
            return Some(*rule);
        }
        let rule = self.rules.get(&rule_slot(generation, id), 0).ok()?;
        let third = match &self.third_words {
            Some(map) if rule.flags & rule_flag::THIRD_LIMIT != 0 => {
                map.get(&rule_slot(generation, id), 0).ok()
            }
            _ => None,
        };
        if generation == active {
            self.rule_cache.insert(id, (rule, third));
        }
        Some((rule, third))
    }
}

impl AsRawFd for KernelTracer {
    /// Readable when decisions wait in the ring.
    fn as_raw_fd(&self) -> RawFd {
        self.events.as_raw_fd()
    }
}

impl Drop for KernelTracer {
    fn drop(&mut self) {
        if let Err(e) = self.config.set(0, TraceConfig::default(), 0) {
            tracing::warn!("stopping the trace: {e}");
        }
    }
}

/// Stops a trace whose tracer died without stopping it (killed): the
/// kernel would go on handing decisions to a ring nobody reads. Whether
/// it stopped one.
pub fn stop_abandoned(pin_dir: &Path) -> Result<bool> {
    let Ok(data) = pinned_data(pin_dir, map_name::TRACE) else {
        return Ok(false);
    };
    let mut config: Array<MapData, TraceConfig> = Map::from_map_data(data)?.try_into()?;
    if config.get(&0, 0)?.on == 0 {
        return Ok(false);
    }
    // Held while it resets, so a tracer starting meanwhile is not stopped:
    // if someone holds it, someone traces.
    let Ok(_lock) = PinLock::trace(pin_dir) else {
        return Ok(false);
    };
    config.set(0, TraceConfig::default(), 0)?;
    Ok(true)
}

/// The id of the rule named `name` in the active generation.
fn rule_id(rules: &Array<MapData, RuleConfig>, generation: u32, name: &str) -> Result<u32> {
    let mut names = Vec::new();
    for (id, rule) in super::maps::named_rules(rules, generation)? {
        let this = String::from_utf8_lossy(rule.name()).into_owned();
        if this == name {
            return Ok(id);
        }
        names.push(this);
    }
    bail!(
        "--rule {name:?}: no such rule (the rules: {})",
        names.join(", ")
    )
}

fn sum(counts: &PerCpuArray<MapData, [u64; 2]>) -> Result<[u64; 2]> {
    let per_cpu = counts.get(&0, 0).context("reading the trace counters")?;
    Ok(per_cpu
        .iter()
        .fold([0, 0], |[a, b], c| [a + c[0], b + c[1]]))
}

fn source(event: &TraceEvent) -> Option<IpAddr> {
    match event.family {
        4 => {
            let [a, b, c, d, ..] = event.addr;
            Some(IpAddr::V4(Ipv4Addr::new(a, b, c, d)))
        }
        6 => Some(IpAddr::V6(Ipv6Addr::from(event.addr))),
        _ => None,
    }
}
