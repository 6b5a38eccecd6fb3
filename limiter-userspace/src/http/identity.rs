//! A key's identity in the store: its rule and its bytes (a masked
//! address, or a keyed digest of the caller's key).

use limiter_common::abi::FlowKey;

/// A key's identity: the rule's index and either the masked client address
/// or a digest of the caller's key. A digest, not the bytes: a client
/// sending 8 KB header values would otherwise make every key cost 8 KB.
/// Keyed per process (as std's maps are), so no one can aim two keys at
/// one digest; 128 bits, so no two keys meet by chance.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum KeyBytes {
    Addr([u8; 16]),
    Custom([u8; 16]),
}

/// Two randomly keyed SipHash instances (std's `RandomState`): a 128-bit
/// digest no one without the keys can aim.
pub(super) struct KeyDigest([std::hash::RandomState; 2]);

impl KeyDigest {
    pub(super) fn new() -> Self {
        Self([std::hash::RandomState::new(), std::hash::RandomState::new()])
    }

    /// The digest of a key made of `parts` (each hashed with its length,
    /// so no two lists of parts meet by concatenation).
    pub(super) fn of(&self, parts: &[&[u8]]) -> [u8; 16] {
        use std::hash::{BuildHasher, Hash, Hasher};
        let [a, b] = &self.0;
        let digest = |state: &std::hash::RandomState| {
            let mut hasher = state.build_hasher();
            for part in parts {
                part.hash(&mut hasher);
            }
            hasher.finish()
        };
        let mut out = [0; 16];
        out[..8].copy_from_slice(&digest(a).to_ne_bytes());
        out[8..].copy_from_slice(&digest(b).to_ne_bytes());
        out
    }
}

/// A key's identity in the store: its rule's index and its bytes, in
/// words (bytes at odd offsets cost a stalled load at every lookup).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct StateKey {
    words: [u64; 2],
    rule: u32,
    /// The bytes are a digest ([`KeyBytes::Custom`]), not an address.
    custom: bool,
}

impl StateKey {
    pub(super) fn new(rule: usize, bytes: KeyBytes) -> Self {
        let (custom, bytes) = match bytes {
            KeyBytes::Addr(a) => (false, a),
            KeyBytes::Custom(a) => (true, a),
        };
        let word = |i: usize| u64::from_ne_bytes(bytes[i * 8..][..8].try_into().expect("8 bytes"));
        Self {
            words: [word(0), word(1)],
            // Validation keeps rules fewer than `abi::MAX_RULES`.
            rule: u32::try_from(rule).expect("rule index fits u32"),
            custom,
        }
    }

    pub(super) fn rule(&self) -> usize {
        self.rule as usize
    }

    /// The key of an IPv4 client's (masked) address `addr` (as
    /// [`super::keys::PlainKeys`] keeps it) under rule `rule`.
    pub(super) fn v4(rule: usize, addr: u32) -> Self {
        Self::new(
            rule,
            KeyBytes::Addr(FlowKey::v4(0, addr.to_be_bytes(), [0xff; 4]).addr),
        )
    }

    /// The IPv4 client address this key is (as [`StateKey::v4`] takes
    /// it), if it is one.
    pub(super) fn ipv4(&self) -> Option<u32> {
        // The address's bytes end the second word.
        let [.., b] = self.words.map(u64::to_ne_bytes);
        let addr = u32::from_be_bytes([b[4], b[5], b[6], b[7]]);
        (*self == Self::v4(self.rule(), addr)).then_some(addr)
    }

    /// The same key under another rule's index (a reload's).
    pub(super) fn new_rule(self, rule: usize) -> Self {
        Self {
            rule: u32::try_from(rule).expect("rule index fits u32"),
            ..self
        }
    }
}

impl std::hash::Hash for StateKey {
    /// In three words: derived, it hashed the array's length too.
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write_u64(self.words[0]);
        state.write_u64(self.words[1]);
        state.write_u64(u64::from(self.rule) << 1 | u64::from(self.custom));
    }
}
