//! The limiter's tests that take more than one of its files (a request's
//! way to its decision, reloads, the key store's bound), and what they
//! and other modules' tests share.

mod keys;
mod plain;
mod reload;

use std::{
    net::IpAddr,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use super::{clock::Clock, decision::RequestMeta, limiter::Limiter, state::State};

/// A header map of `fields`, in order (several of one name are kept).
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

fn limiter(text: &str, clock: Arc<dyn Clock>) -> Limiter {
    let rules = crate::rules::RuleSet::parse(text, std::path::Path::new("t.yaml")).expect("rules");
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
