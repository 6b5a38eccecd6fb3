//! The connections a listener may serve at once, in all and per client
//! address: a slot per connection, given back when it ends.

use std::{
    collections::HashMap,
    net::IpAddr,
    sync::{Arc, Mutex},
};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::limits::Limits;

/// The connections a listener may serve at once, in all and from one
/// client address.
#[derive(Clone)]
pub struct Slots {
    all: Arc<Semaphore>,
    per_source: usize,
    /// Connections held per client address (those with any).
    sources: Held,
    /// Addresses held to no per-source cap (trusted proxies, which carry
    /// many clients' connections).
    exempt: Arc<[ipnet::IpNet]>,
}

/// A connection's slot, given back when dropped.
pub struct Slot {
    _all: OwnedSemaphorePermit,
    source: Option<(Held, IpAddr)>,
}

/// Connections held per client address, shared by a listener's slots.
type Held = Arc<Mutex<HashMap<IpAddr, usize>>>;

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some((sources, addr)) = &self.source {
            let mut sources = sources.lock().expect("slots lock");
            if let Some(n) = sources.get_mut(addr) {
                *n -= 1;
                if *n == 0 {
                    sources.remove(addr);
                }
            }
        }
    }
}

impl Slots {
    /// `max` connections at once, `per_source` of them from one address.
    pub fn new(max: usize, per_source: usize) -> Self {
        Self {
            all: Arc::new(Semaphore::new(max)),
            per_source,
            sources: Arc::default(),
            exempt: Arc::new([]),
        }
    }

    /// Slots for `limits`.
    pub fn of(limits: &Limits) -> Self {
        Self::new(limits.max_connections, limits.per_source())
    }

    /// With no per-source cap for these addresses.
    pub fn exempt(self, exempt: &[ipnet::IpNet]) -> Self {
        Self {
            exempt: exempt.into(),
            ..self
        }
    }

    /// A slot for one connection, held until it ends; `None` when full.
    /// With `source`, also `None` when that address holds its share.
    pub fn take(&self, source: Option<IpAddr>) -> Option<Slot> {
        // Given back when dropped, also when this returns `None` below.
        let all = Arc::clone(&self.all).try_acquire_owned().ok()?;
        let source = source
            .map(|a| a.to_canonical())
            .filter(|a| !self.exempt.iter().any(|net| net.contains(a)));
        let source = match source {
            None => None,
            Some(addr) => {
                let mut sources = self.sources.lock().expect("slots lock");
                let n = sources.entry(addr).or_default();
                if *n >= self.per_source {
                    return None;
                }
                *n += 1;
                Some((Arc::clone(&self.sources), addr))
            }
        };
        Some(Slot { _all: all, source })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A share per address within the whole: a slot refused for the
    /// address gives its place in the whole back, a slot dropped gives
    /// both back, and an exempt address has only the whole.
    #[test]
    fn slots_are_shared_per_source_within_the_whole() {
        let (a, b): (IpAddr, IpAddr) = ("192.0.2.1".parse().unwrap(), "192.0.2.2".parse().unwrap());
        let slots = Slots::new(3, 2);
        let a1 = slots.take(Some(a)).expect("a's first");
        let _a2 = slots.take(Some(a)).expect("a's second");
        assert!(slots.take(Some(a)).is_none(), "a's share is 2");
        let _b1 = slots.take(Some(b)).expect("b has the third");
        assert!(slots.take(Some(b)).is_none(), "the whole is 3");
        drop(a1);
        assert!(slots.take(Some(a)).is_some(), "a's slot given back");
        let exempt = Slots::new(3, 1).exempt(&["192.0.2.0/24".parse().unwrap()]);
        let held: Vec<Slot> = (0..3)
            .map(|_| exempt.take(Some(a)).expect("exempt"))
            .collect();
        assert!(exempt.take(Some(b)).is_none());
        drop(held);
        assert!(exempt.take(None).is_some());
    }
}
