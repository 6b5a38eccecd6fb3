//! `limiter proxy --trace`: layer 7's decisions as `limiter trace` shows
//! the kernel's, with the same filter and the same line (the interface is
//! the proxy's listening address, the protocol `http`, and a request is
//! what a packet is to the kernel). Lines go to stdout through a bounded
//! queue and a thread of their own: a reader that stalls (a full pipe)
//! never holds a request up; lines it could not take are dropped and
//! counted (`limiter_trace_lines_dropped_total`, and a warning on the
//! first and every 10,000th).

use std::{
    borrow::Cow,
    io::Write,
    net::IpAddr,
    sync::{
        Arc,
        atomic::{AtomicU32, AtomicU64, Ordering},
        mpsc::{SyncSender, TrySendError, sync_channel},
    },
};

use anyhow::Result;
use limiter_common::trace::{ANY_RULE, TraceConfig, TraceEvent, verdict};

use super::{decision::Decision, limiter::Limiter};
use crate::{
    rules::{HttpRequest, KeyPart},
    trace::{JudgedRequest, Left, TraceFilter, TraceLine, header, limit_name, refused_by, time_of},
};

/// Prints the decisions a filter selects to stdout, text or JSON.
pub struct HttpTracer {
    config: TraceConfig,
    rule: Option<String>,
    interface: String,
    json: bool,
    /// Decisions that matched, for sampling one in N.
    matched: AtomicU32,
    /// Lines for the writer thread.
    lines: SyncSender<String>,
    /// Lines dropped because the queue was full.
    dropped: Arc<AtomicU64>,
}

/// Lines queued for stdout at most: beyond, they are dropped.
const QUEUE: usize = 4096;

impl HttpTracer {
    pub fn new(filter: &TraceFilter, interface: String, json: bool) -> Result<Self> {
        let mut config = filter.config(None, 0)?;
        config.rule = ANY_RULE;
        if !json {
            println!("{}", header());
        }
        let (lines, queue) = sync_channel::<String>(QUEUE);
        std::thread::Builder::new()
            .name("trace-writer".into())
            .spawn(move || {
                let mut out = std::io::stdout();
                for line in queue {
                    // A reader gone: nothing more to write to.
                    if writeln!(out, "{line}").and_then(|()| out.flush()).is_err() {
                        break;
                    }
                }
            })?;
        Ok(Self {
            config,
            rule: filter.rule.clone(),
            interface,
            json,
            matched: AtomicU32::new(0),
            lines,
            dropped: Arc::default(),
        })
    }

    /// Lines dropped because stdout was not read fast enough.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Prints the decision if the filter wants it (and the sample keeps it).
    pub fn record(
        &self,
        decision: &Decision,
        limiter: &Limiter,
        client: IpAddr,
        port: Option<u16>,
        bytes: u64,
        request: Option<&HttpRequest<'_>>,
    ) {
        let blocked = decision.refused_by == Some(limiter_common::trace::reason::ESCALATED);
        let verdict = match (decision.allowed, decision.shadow) {
            (_, true) => verdict::SHADOW,
            (true, false) => verdict::PASSED,
            (false, false) if blocked => verdict::BLOCKED,
            (false, false) => verdict::DROPPED,
        };
        // (No rule id: layer 7 filters by the rule's name, below.)
        let mut event = TraceEvent {
            verdict,
            ..TraceEvent::default()
        };
        match client {
            IpAddr::V4(a) => {
                event.family = 4;
                event.addr[..4].copy_from_slice(&a.octets());
            }
            IpAddr::V6(a) => {
                event.family = 6;
                event.addr = a.octets();
            }
        }
        let rule = limiter.rule_name(decision);
        if !self.config.wants(&event) || self.rule.as_deref().is_some_and(|r| r != rule) {
            return;
        }
        if !self
            .config
            .sampled(self.matched.fetch_add(1, Ordering::Relaxed))
        {
            return;
        }
        let rule_config = decision.rule.map(|i| &limiter.rules().rules[i]);
        let refused_by = decision.refused_by.and_then(|r| {
            let second = rule_config.is_some_and(|r| r.second_packets.is_some());
            let third_bytes = rule_config.is_some_and(|r| r.third.is_some_and(|t| t.counts_bytes));
            refused_by(r).map(|_| limit_name(r, second, third_bytes).to_owned())
        });
        let left = limiter
            .budget(decision)
            .map(|(left, of)| Left {
                meter: "key packets".into(),
                left,
                of,
            })
            .into_iter()
            .collect();
        let line = TraceLine {
            time: time_of(crate::clock::realtime_ns()),
            layer: "http".into(),
            interface: self.interface.clone(),
            source: Some(client),
            protocol: "http".into(),
            port,
            rule: rule.to_owned(),
            verdict: verdict::name(verdict).into(),
            refused_by,
            left,
            bytes,
            request: request.map(|request| judged(request, rule_config)),
        };
        let text = if self.json {
            serde_json::to_string(&line).expect("a trace line serializes")
        } else {
            line.text()
        };
        if let Err(TrySendError::Full(_)) = self.lines.try_send(text) {
            let n = self.dropped.fetch_add(1, Ordering::Relaxed) + 1;
            if n == 1 || n.is_multiple_of(10_000) {
                tracing::warn!(
                    event = "trace_lines_dropped",
                    dropped = n,
                    "--trace: {n} lines dropped so far: stdout is not read as fast as requests are traced"
                );
            }
        }
    }
}

/// What the rules judged of `request`: its canonical host, its path as
/// nginx routes it, and the values of the fields `rule` keys by.
fn judged(request: &HttpRequest<'_>, rule: Option<&crate::rules::Rule>) -> JudgedRequest {
    let fields = rule
        .map(|rule| {
            rule.keyed_by
                .iter()
                .filter_map(|part| match part {
                    KeyPart::Header(name) => Some((
                        name.as_str().to_owned(),
                        String::from_utf8_lossy(&part.of(Some(request))?).into_owned(),
                    )),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default();
    JudgedRequest {
        host: request.canonical_host().map(Cow::into_owned),
        path: request.path().into_owned(),
        fields,
    }
}
