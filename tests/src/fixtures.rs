//! What a test makes for itself: rule sets from text, scratch
//! directories, and seeded random choices.

use std::{
    fs,
    path::{Path, PathBuf},
};

use limiter::rules::RuleSet;

/// xorshift64*: a test's random choices, the same for the same seed (a
/// nonzero one), so a failure is reproduced from the seed it prints.
pub struct Rng(pub u64);

impl Rng {
    pub fn word(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number below `n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.word() % n.max(1) as u64) as usize
    }

    /// True `percent` times in 100.
    pub fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }

    pub fn pick<'a>(&mut self, from: &[&'a str]) -> &'a str {
        from[self.below(from.len())]
    }
}

/// Parses rule-file text (panicking with the error: a test bug).
pub fn rules(text: &str) -> RuleSet {
    RuleSet::parse(text, Path::new("test.yaml")).unwrap_or_else(|e| panic!("{e}"))
}

/// A scratch directory, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("limiter-test-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("creating a temp dir");
        Self(dir)
    }

    pub fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        fs::write(&path, text).expect("writing a temp file");
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}
