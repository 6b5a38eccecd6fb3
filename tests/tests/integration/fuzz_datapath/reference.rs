//! The reference's judgement of a parsed frame, by the policy the README
//! states: its verdict class and the counters it moves.

use std::{collections::HashMap, net::IpAddr};

use ipnet::IpNet;
use limiter::rules::{RuleSet, matching::match_order};
use limiter_tests::{XDP_DROP, XDP_PASS, rules};

use super::{
    BLOCKS, RULES,
    parse::{Packet, Parsed, Port, UNKNOWN_PROTOCOL, reference_parse},
};

/// What the program does with a frame, as the counters show it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Class {
    NonIp,
    Malformed,
    Tiny,
    Blocked,
    Rule(String),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Outcome {
    pub(super) action: u32,
    pub(super) class: Class,
    pub(super) ipv4: u64,
    pub(super) ipv6: u64,
    pub(super) fragments: u64,
    pub(super) unreadable: u64,
}

/// The reference's judgement, with the memory of first fragments (source,
/// datagram) -> rule that later ones follow.
pub(super) struct Reference {
    pub(super) set: RuleSet,
    pub(super) order: Vec<usize>,
    pub(super) blocks: Vec<IpNet>,
    pub(super) firsts: HashMap<(IpAddr, u64), String>,
}

impl Reference {
    pub(super) fn new() -> Self {
        let set = rules(RULES);
        Self {
            order: match_order(&set),
            blocks: BLOCKS.iter().map(|b| b.parse().unwrap()).collect(),
            set,
            firsts: HashMap::new(),
        }
    }

    /// The first rule, most specific first, whose source covers the packet
    /// and that matches its protocol and port. When the port is unknown
    /// and the protocol has ports (TCP, UDP, SCTP) or is unknown: of the
    /// rules that could apply whatever the port, up to the first that
    /// surely does (the default too if none does), the one of least
    /// `bytes_per_second_bound`, the first of equals; for other protocols
    /// the first that could apply. (Every rule here is metered, so none is
    /// an exemption not to apply on a guess.)
    fn rule(&self, p: &Packet) -> String {
        let covers = |i: usize| {
            let m = &self.set.rules[i].matches;
            m.source.is_none_or(|s| s.contains(&p.source))
        };
        let may = |i: usize| {
            let m = &self.set.rules[i].matches;
            let protocol_ok = m.protocol.is_none_or(|x| x == p.protocol);
            let port_ok = m.dest_port.is_none_or(|x| p.port == Port::Known(x));
            let unknown_ok = p.port == Port::Unknown
                && (m.protocol.is_none()
                    || p.protocol == UNKNOWN_PROTOCOL
                    || m.protocol == Some(p.protocol));
            (protocol_ok && port_ok) || unknown_ok
        };
        let name = |i: Option<usize>| {
            i.map_or_else(|| "default".to_owned(), |i| self.set.rules[i].name.clone())
        };
        let candidates = self.order.iter().copied().filter(|&i| covers(i));
        if p.port != Port::Unknown || ![6, 17, 132, UNKNOWN_PROTOCOL].contains(&p.protocol) {
            return name(candidates.clone().find(|&i| may(i)));
        }
        let mut best: Option<(Option<usize>, f64)> = None;
        let mut surely = false;
        for i in candidates.filter(|&i| may(i)) {
            let bound = self.set.rules[i].bytes_per_second_bound();
            if best.is_none_or(|(_, least)| bound < least) {
                best = Some((Some(i), bound));
            }
            let m = &self.set.rules[i].matches;
            let protocol_sure = m.protocol.is_none()
                || (p.protocol != UNKNOWN_PROTOCOL && m.protocol == Some(p.protocol));
            if protocol_sure && m.dest_port.is_none() {
                surely = true;
                break;
            }
        }
        if !surely && best.is_none_or(|(_, least)| f64::INFINITY < least) {
            // The default passes: no bound, so only when nothing else may apply.
            best = Some((None, f64::INFINITY));
        }
        name(best.and_then(|(i, _)| i))
    }

    pub(super) fn judge(&mut self, frame: &[u8]) -> Outcome {
        let mut out = Outcome {
            action: XDP_PASS,
            class: Class::NonIp,
            ipv4: 0,
            ipv6: 0,
            fragments: 0,
            unreadable: 0,
        };
        let p = match reference_parse(frame) {
            Parsed::NonIp => return out,
            Parsed::Malformed => {
                out.class = Class::Malformed;
                return out;
            }
            Parsed::Ip(p) => p,
        };
        match p.source {
            IpAddr::V4(_) => out.ipv4 = 1,
            IpAddr::V6(_) => out.ipv6 = 1,
        }
        out.fragments = u64::from(p.fragment);
        out.unreadable = u64::from(p.unreadable);
        if p.tiny {
            out.class = Class::Tiny;
            out.action = XDP_DROP;
            return out;
        }
        let key = (p.source, p.datagram);
        let first = (p.later_fragment && !p.unreadable)
            .then(|| self.firsts.get(&key).cloned())
            .flatten();
        let rule = first.unwrap_or_else(|| self.rule(&p));
        if self.blocks.iter().any(|b| b.contains(&p.source)) {
            out.class = Class::Blocked;
            out.action = XDP_DROP;
            return out;
        }
        if p.first_fragment {
            self.firsts.insert(key, rule.clone());
        }
        out.class = Class::Rule(rule);
        out
    }
}
