//! What the limiter is asked and what it answers: a request as it sees
//! it, and the decision (with the quota its response may carry).

use std::{net::IpAddr, sync::Arc};

use serde::Serialize;

use super::state::InFlight;
use crate::rules::HttpRequest;

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

/// What the limiter decided of a request, and what to tell the client
/// (the kernel's for a packet is `limiter-ebpf`'s `trace::Decision`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    /// Forward the request.
    pub allowed: bool,
    /// Excess let through by a dry run.
    pub shadow: bool,
    /// The index of the rule that applied (`None`: the default); its name
    /// is [`crate::http::Limiter::rule_name`]'s.
    pub rule: Option<usize>,
    /// What the rule's packet (request) limit said, for
    /// [`crate::http::Limiter::quota`]: the fields are computed only for a
    /// response that carries them.
    pub(super) quota: Option<QuotaAt>,
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

/// A key's request meter as the request left it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum QuotaAt {
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

impl Decision {
    /// A decision with no meter behind it; `refused_by` what refused it.
    pub(super) fn plain(
        allowed: bool,
        shadow: bool,
        rule: Option<usize>,
        refused_by: Option<u8>,
    ) -> Self {
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

/// `request` from the IPv4 client it is from, if a dual-stack listener saw
/// it as `::ffff:a.b.c.d` (`None` otherwise: the request as it is, not
/// copied on every request).
pub(super) fn ipv4_mapped<'r>(request: &RequestMeta<'r>) -> Option<RequestMeta<'r>> {
    match request.client {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(|v4| RequestMeta {
            client: IpAddr::V4(v4),
            ..*request
        }),
        IpAddr::V4(_) => None,
    }
}
