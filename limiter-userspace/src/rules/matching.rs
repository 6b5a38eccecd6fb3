//! Which rule applies to a packet: the one place that defines it. The
//! kernel's trie entries list candidates in [`match_order`], and layer 7
//! and the lab ask [`first_match`]; both mask sources with [`key_masks`].

use std::{collections::HashMap, net::IpAddr};

use ipnet::IpNet;

use super::{
    request::{HttpRequest, KeyPart, PathMatch, RequestMatch, keyable},
    set::{Match, Rule, RuleSet},
};

/// The masks that turn a source address into the rule's key, for IPv4 and
/// IPv6 (network byte order): the kernel and the L7 limiter both use them.
pub fn key_masks(rule: &Rule) -> ([u8; 4], [u8; 16]) {
    (
        (u32::MAX
            .checked_shl(32 - u32::from(rule.key.v4))
            .unwrap_or(0))
        .to_be_bytes(),
        (u128::MAX
            .checked_shl(128 - u32::from(rule.key.v6))
            .unwrap_or(0))
        .to_be_bytes(),
    )
}

/// Every prefix that needs a trie entry: each rule's source, and /0 of both
/// families when a rule matches any source.
pub fn all_prefixes(set: &RuleSet) -> Vec<IpNet> {
    let mut nets: Vec<IpNet> = Vec::new();
    for rule in &set.rules {
        let sources = match rule.matches.source {
            Some(net) => vec![net],
            None => vec![
                "0.0.0.0/0".parse().expect("literal"),
                "::/0".parse().expect("literal"),
            ],
        };
        for net in sources {
            if !nets.contains(&net) {
                nets.push(net);
            }
        }
    }
    nets
}

/// Indexes of the rules whose source covers `net`, most specific first:
/// longer source prefix, then protocol and port, then protocol, then file order.
pub fn covering_rules(set: &RuleSet, net: IpNet) -> Vec<usize> {
    match_order(set)
        .into_iter()
        .filter(|&i| {
            set.rules[i]
                .matches
                .source
                .is_none_or(|source| source.contains(&net))
        })
        .collect()
}

/// Every rule, most specific first: more layer-7 conditions (method,
/// host, path, each header), then longer source prefix, then protocol and
/// port, then protocol only, then neither, then file order. The kernel's
/// trie entries list their candidates in this order (its rules have no
/// layer-7 conditions).
pub fn match_order(set: &RuleSet) -> Vec<usize> {
    let mut order: Vec<usize> = (0..set.rules.len()).collect();
    order.sort_by_key(|&i| {
        let rule = &set.rules[i];
        let m = &rule.matches;
        let prefix = m.source.map_or(0, |s| s.prefix_len());
        let specificity = u8::from(m.protocol.is_some())
            + u8::from(m.dest_port.is_some())
            + u8::from(m.tcp_flags.is_some());
        (
            std::cmp::Reverse(rule.request.conditions()),
            std::cmp::Reverse(prefix),
            std::cmp::Reverse(specificity),
            i,
        )
    });
    order
}

/// The first rule in `order` ([`match_order`]) that applies to a packet
/// from `source` with this protocol, port and TCP flags (`None`: not a
/// TCP segment, or flags unknown): the rule the kernel applies.
pub fn first_match(
    set: &RuleSet,
    order: &[usize],
    source: IpAddr,
    protocol: u8,
    dest_port: Option<u16>,
    tcp_flags: Option<u8>,
) -> Option<usize> {
    order.iter().copied().find(|&i| {
        set.rules[i]
            .matches
            .applies(source, protocol, dest_port, tcp_flags)
    })
}

impl Match {
    /// Whether a packet from `source` with this protocol, port and TCP
    /// flags is one this match names.
    fn applies(
        &self,
        source: IpAddr,
        protocol: u8,
        dest_port: Option<u16>,
        tcp_flags: Option<u8>,
    ) -> bool {
        self.source.is_none_or(|s| s.contains(&source))
            && self.protocol.is_none_or(|p| p == protocol)
            && self.dest_port.is_none_or(|p| Some(p) == dest_port)
            && self
                .tcp_flags
                .is_none_or(|f| tcp_flags.is_some_and(|t| t & f.mask == f.value))
    }
}

/// The first rule in `order` that applies to an HTTP request from `source`
/// to `dest_port` (TCP): its addresses, its fields (`None`: a caller that
/// tells only addresses, which rules with layer-7 conditions never match),
/// and the headers the rule's key is made of, which it must carry.
pub fn first_request_match(
    set: &RuleSet,
    order: &[usize],
    source: IpAddr,
    dest_port: Option<u16>,
    request: Option<&HttpRequest<'_>>,
) -> Option<usize> {
    order
        .iter()
        .copied()
        .find(|&i| request_applies(&set.rules[i], source, dest_port, request))
}

/// A request's transport, for the rules' `protocol`.
const TCP: u8 = 6;

/// Whether `rule` applies to an HTTP request (see [`first_request_match`]).
fn request_applies(
    rule: &Rule,
    source: IpAddr,
    dest_port: Option<u16>,
    request: Option<&HttpRequest<'_>>,
) -> bool {
    // A request is not a segment: a rule on TCP flags (connection
    // attempts) is the kernel's and never matches one.
    rule.matches.applies(source, TCP, dest_port, None)
        && rule.request.matches(request)
        && keyable(&rule.keyed_by, request)
}

/// [`first_request_match`] by an index of the rules' sources and paths: a
/// request tries only the rules whose source covers its address (one
/// lookup per distinct prefix length among the rules, and the rules of
/// any source) and whose path or host condition, if any, it meets (see
/// [`ByTarget`]), not every rule in turn (at 1,000 rules that took 6.7 µs a
/// request, and a flood from addresses or paths no rule names made every
/// request take it).
pub struct RequestRules {
    order: Vec<usize>,
    /// The rules of any source.
    any: ByTarget,
    /// The distinct source prefix lengths of IPv4 and IPv6 rules.
    lengths: [Vec<u8>; 2],
    /// By source prefix: its rules.
    by_source: HashMap<IpNet, ByTarget, foldhash::fast::RandomState>,
    /// By position in `order`: the rule applies to every request from its
    /// source (no port, no layer-7 field, keyed by the address alone), so
    /// a list it is on takes it without asking (most rules: the question
    /// was a quarter of a decision's time).
    plain: Vec<bool>,
    /// The earliest position of a rule with a source (`u32::MAX`: none).
    first_by_source: u32,
    /// The position of the first rule of any source that applies by the
    /// source alone (`u32::MAX`: none): it applies to every request, so
    /// only rules before it are asked (a rule file ending in a catch-all,
    /// or made of one, answers in a compare).
    catch_all: u32,
}

/// Positions in `order` (each list ascending) of the rules of one source
/// (or of any), by what they ask of a request's path and host: as an
/// envoy configuration's routes and virtual hosts convert, there can be
/// hundreds, and a request tries only those of its own path, of its
/// path's prefixes, of its host, and the rest.
struct ByTarget {
    /// Those that ask nothing of the path or the host.
    rest: Vec<u32>,
    /// By the host they name (lowercase), of those that ask nothing of
    /// the path.
    host: HashMap<Box<str>, Vec<u32>, foldhash::fast::RandomState>,
    /// By the path they match exactly.
    exact: HashMap<Box<str>, Vec<u32>, foldhash::fast::RandomState>,
    /// By the path prefix they match, and the prefixes' distinct lengths.
    prefix: HashMap<Box<str>, Vec<u32>, foldhash::fast::RandomState>,
    prefix_lengths: Vec<usize>,
    /// The earliest position on a list by host or path (`u32::MAX`:
    /// none): a request already matched before it looks none of them up.
    first_targeted: u32,
}

impl Default for ByTarget {
    fn default() -> Self {
        Self {
            rest: Vec::new(),
            host: HashMap::default(),
            exact: HashMap::default(),
            prefix: HashMap::default(),
            prefix_lengths: Vec::new(),
            first_targeted: u32::MAX,
        }
    }
}

impl ByTarget {
    fn push(&mut self, position: u32, conditions: &RequestMatch) {
        if conditions.path.is_some() || conditions.host.is_some() {
            self.first_targeted = self.first_targeted.min(position);
        }
        let list = match (&conditions.path, &conditions.host) {
            (None, None) => &mut self.rest,
            (None, Some(host)) => self.host.entry(host.as_str().into()).or_default(),
            (Some(PathMatch::Exact(path)), _) => {
                self.exact.entry(path.as_str().into()).or_default()
            }
            (Some(PathMatch::Prefix(prefix)), _) => {
                if !self.prefix_lengths.contains(&prefix.len()) {
                    self.prefix_lengths.push(prefix.len());
                }
                self.prefix.entry(prefix.as_str().into()).or_default()
            }
        };
        list.push(position);
    }

    /// The earliest position on any list (`u32::MAX`: none; positions
    /// are pushed in ascending order).
    fn first(&self) -> u32 {
        self.rest
            .first()
            .copied()
            .unwrap_or(u32::MAX)
            .min(self.first_targeted)
    }

    /// The lists that may hold a rule applying to `request` (`None`: a
    /// caller that tells only addresses) at a position before `best`.
    fn lists<'s>(
        &'s self,
        request: Option<&HttpRequest<'s>>,
        best: u32,
    ) -> impl Iterator<Item = &'s [u32]> {
        let request = request.filter(|_| self.first_targeted < best);
        let path = request.map(HttpRequest::path);
        let by_host = request
            .filter(|_| !self.host.is_empty())
            .and_then(HttpRequest::canonical_host)
            .and_then(|host| self.host.get(host.as_ref()));
        let exact = path.as_deref().and_then(|path| self.exact.get(path));
        let prefixes = path.into_iter().flat_map(move |path| {
            self.prefix_lengths
                .iter()
                .filter_map(move |&n| self.prefix.get(path.get(..n)?))
        });
        std::iter::once(&self.rest)
            .chain(by_host)
            .chain(exact)
            .chain(prefixes)
            .map(Vec::as_slice)
    }
}

/// Whether `rule` applies to every HTTP request from an address its source
/// covers (see [`request_applies`]).
fn applies_by_source_alone(rule: &Rule) -> bool {
    let m = &rule.matches;
    m.protocol.is_none_or(|p| p == TCP)
        && m.dest_port.is_none()
        && m.tcp_flags.is_none()
        && rule.request.is_empty()
        && rule.keyed_by.iter().all(|p| *p == KeyPart::Source)
}

impl RequestRules {
    pub fn new(set: &RuleSet) -> Self {
        let order = match_order(set);
        let mut any = ByTarget::default();
        let mut lengths: [Vec<u8>; 2] = Default::default();
        let mut by_source: HashMap<_, ByTarget, _> = HashMap::default();
        for (position, &i) in order.iter().enumerate() {
            let position = u32::try_from(position).expect("rules fewer than 2^32");
            let conditions = &set.rules[i].request;
            match set.rules[i].matches.source {
                None => any.push(position, conditions),
                Some(net) => {
                    let lengths = &mut lengths[usize::from(net.network().is_ipv6())];
                    if !lengths.contains(&net.prefix_len()) {
                        lengths.push(net.prefix_len());
                    }
                    by_source
                        .entry(net.trunc())
                        .or_default()
                        .push(position, conditions);
                }
            }
        }
        let plain: Vec<bool> = order
            .iter()
            .map(|&i| applies_by_source_alone(&set.rules[i]))
            .collect();
        let catch_all = any
            .rest
            .iter()
            .copied()
            .find(|&p| plain[p as usize])
            .unwrap_or(u32::MAX);
        let first_by_source = (0..order.len())
            .find(|&p| set.rules[order[p]].matches.source.is_some())
            .map_or(u32::MAX, |p| p as u32);
        Self {
            order,
            any,
            lengths,
            by_source,
            plain,
            first_by_source,
            catch_all,
        }
    }

    /// The rule [`first_request_match`] finds, found by the index.
    /// (`source` and `dest_port` by reference, read only if asked: a
    /// caller that has just written them in pieces stalls on reading them
    /// back whole, a twentieth of a decision each.)
    #[inline(always)]
    pub fn first(
        &self,
        set: &RuleSet,
        source: &IpAddr,
        dest_port: &Option<u16>,
        request: Option<&HttpRequest<'_>>,
    ) -> Option<usize> {
        // The earliest position in `order` of a rule that applies: each
        // list is in order, so its first rule that applies is its best.
        let mut best = self.catch_all;
        let try_list = |best: &mut u32, positions: &[u32]| {
            for &position in positions.iter().take_while(|&&p| p < *best) {
                let i = self.order[position as usize];
                // (On a list, a rule's source covers the address.)
                if self.plain[position as usize]
                    || request_applies(&set.rules[i], *source, *dest_port, request)
                {
                    *best = position;
                    return;
                }
            }
        };
        // (Iterating no list at all is a tenth of a decision's time.)
        if self.any.first() < best {
            for list in self.any.lists(request, best) {
                try_list(&mut best, list);
            }
        }
        if self.first_by_source < best {
            for &length in &self.lengths[usize::from(source.is_ipv6())] {
                // (A length of the source's family: always valid.)
                let covering = IpNet::new(*source, length).map(|net| net.trunc());
                if let Some(rules) = covering.ok().and_then(|net| self.by_source.get(&net)) {
                    for list in rules.lists(request, best) {
                        try_list(&mut best, list);
                    }
                }
            }
        }
        (best != u32::MAX).then(|| self.order[best as usize])
    }
}

/// [`first_match`] for a one-off question (`limiter lab`'s table).
pub fn matching_rule(
    set: &RuleSet,
    source: IpAddr,
    protocol: u8,
    dest_port: Option<u16>,
) -> Option<usize> {
    first_match(set, &match_order(set), source, protocol, dest_port, None)
}
