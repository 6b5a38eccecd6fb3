//! Which key a request is counted under: among the plain keys, or by its
//! rule's key parts (the masked address, the caller's key, its fields).

use std::net::IpAddr;

use limiter_common::abi::FlowKey;

use super::{
    decision::RequestMeta,
    identity::{KeyBytes, StateKey},
    keys,
    limiter::Limiter,
};
use crate::rules::{KeyPart, Rule};

impl Limiter {
    /// The request's key among the plain keys ([`keys::PlainKeys`]): a
    /// plain rule's, keyed by an IPv4 client's address.
    #[inline]
    pub(super) fn plain_key(
        &self,
        index: usize,
        rule: &Rule,
        request: &RequestMeta<'_>,
    ) -> Option<u64> {
        let slot = self.plain[index]?;
        match (request.client, request.key, rule.keyed_by.as_slice()) {
            (IpAddr::V4(addr), None, [KeyPart::Source]) => {
                let mask = u32::from_be_bytes(self.key_masks[index].0);
                Some(keys::PlainKeys::key(slot, u32::from(addr) & mask))
            }
            _ => None,
        }
    }

    /// A request's key under `rule`: the caller's key or the client address
    /// masked exactly as the kernel masks it, and the request's fields the
    /// rule is keyed by besides.
    #[inline]
    pub(super) fn state_key(
        &self,
        index: usize,
        rule: &Rule,
        request: &RequestMeta<'_>,
    ) -> StateKey {
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
}
