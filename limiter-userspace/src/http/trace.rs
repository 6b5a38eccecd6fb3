//! `limiter proxy --trace`: layer 7's decisions as `limiter trace` shows
//! the kernel's, with the same filter and the same line (the interface is
//! the proxy's listening address, the protocol `http`, and a request is
//! what a packet is to the kernel).

use std::{
    io::Write,
    net::IpAddr,
    sync::atomic::{AtomicU32, Ordering},
};

use anyhow::Result;
use limiter_common::trace::{ANY_RULE, TraceConfig, TraceEvent, verdict};

use super::{Admission, Limiter};
use crate::trace::{Left, TraceFilter, TraceLine, header, limit_name, refused_by, time_of};

/// Prints the decisions a filter selects to stdout, text or JSON.
pub struct HttpTracer {
    config: TraceConfig,
    rule: Option<String>,
    interface: String,
    json: bool,
    /// Decisions that matched, for sampling one in N.
    matched: AtomicU32,
}

impl HttpTracer {
    pub fn new(filter: &TraceFilter, interface: String, json: bool) -> Result<Self> {
        let mut config = filter.config(None, 0)?;
        config.rule = ANY_RULE;
        if !json {
            println!("{}", header());
        }
        Ok(Self {
            config,
            rule: filter.rule.clone(),
            interface,
            json,
            matched: AtomicU32::new(0),
        })
    }

    /// Prints the decision if the filter wants it (and the sample keeps it).
    pub fn record(
        &self,
        admission: &Admission,
        limiter: &Limiter,
        client: IpAddr,
        port: Option<u16>,
        bytes: u64,
    ) {
        let blocked = admission.refused_by == Some(limiter_common::trace::reason::ESCALATED);
        let verdict = match (admission.allowed, admission.shadow) {
            (_, true) => verdict::SHADOW,
            (true, false) => verdict::PASSED,
            (false, false) if blocked => verdict::BLOCKED,
            (false, false) => verdict::DROPPED,
        };
        let mut event = TraceEvent {
            verdict,
            rule: ANY_RULE,
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
        let rule = limiter.rule_name(admission);
        if !self.config.wants(&event) || self.rule.as_deref().is_some_and(|r| r != rule) {
            return;
        }
        if !self
            .config
            .sampled(self.matched.fetch_add(1, Ordering::Relaxed))
        {
            return;
        }
        let rule_config = admission.rule.map(|i| &limiter.rules().rules[i]);
        let refused_by = admission.refused_by.and_then(|r| {
            let second = rule_config.is_some_and(|r| r.second_packets.is_some());
            let third_bytes = rule_config.is_some_and(|r| r.third.is_some_and(|t| t.counts_bytes));
            refused_by(r).map(|_| limit_name(r, second, third_bytes).to_owned())
        });
        let left = limiter
            .budget(admission)
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
        };
        let text = if self.json {
            serde_json::to_string(&line).expect("a trace line serializes")
        } else {
            line.text()
        };
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{text}");
        let _ = out.flush();
    }
}
