//! Whether a rule file changed on disk since it was last read (the
//! daemon's `watch: true`, `limiter proxy --watch`), by its contents: a
//! modification time misses a second write within its tick. A change is
//! reported once the contents have held still for a poll, so a file being
//! written in place (`cp`, `cat >`) is not read half-written: a prefix of
//! a rule file can be a valid file with rules missing, and applying it
//! would drop their buckets.

use std::{
    hash::{DefaultHasher, Hash, Hasher},
    path::{Path, PathBuf},
};

pub struct FileWatch {
    path: PathBuf,
    /// The contents last read (a digest; `None`: unreadable).
    read: Option<u64>,
    /// Different contents seen at the last poll, waiting to hold still.
    pending: Option<Option<u64>>,
}

impl FileWatch {
    /// Watches `path`, as it is now.
    pub fn new(path: &Path) -> Self {
        Self {
            path: path.to_owned(),
            read: digest(path),
            pending: None,
        }
    }

    /// Whether it changed since it was last read, and has held still
    /// since the last call (call it once per poll).
    pub fn changed(&mut self) -> bool {
        let now = digest(&self.path);
        if now == self.read {
            self.pending = None;
            return false;
        }
        if self.pending == Some(now) {
            self.pending = None;
            self.read = now;
            return true;
        }
        self.pending = Some(now);
        false
    }

    /// It was read (for another reason, a signal): only later changes count.
    pub fn read(&mut self) {
        self.read = digest(&self.path);
        self.pending = None;
    }
}

fn digest(path: &Path) -> Option<u64> {
    let bytes = std::fs::read(path).ok()?;
    let mut hasher = DefaultHasher::new();
    bytes.hash(&mut hasher);
    Some(hasher.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_counts_once_it_holds_still_for_a_poll() {
        let dir = std::env::temp_dir().join(format!("filewatch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("rules.yaml");
        std::fs::write(&path, "rules: []\n").unwrap();
        let mut watch = FileWatch::new(&path);
        assert!(!watch.changed());
        // Half written at one poll, whole at the next: neither applied yet.
        std::fs::write(&path, "rules:\n  - { name: a").unwrap();
        assert!(!watch.changed());
        std::fs::write(&path, "rules:\n  - { name: a, limit: unlimited }\n").unwrap();
        assert!(!watch.changed());
        // Held still: now.
        assert!(watch.changed());
        assert!(!watch.changed());
        // Written twice within a modification time's tick: seen anyway.
        std::fs::write(&path, "rules: []\n").unwrap();
        std::fs::write(&path, "rules: [ ]\n").unwrap();
        assert!(!watch.changed());
        assert!(watch.changed());
        // Read on a signal: nothing pending.
        std::fs::write(&path, "rules: []\n").unwrap();
        assert!(!watch.changed());
        watch.read();
        assert!(!watch.changed());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
