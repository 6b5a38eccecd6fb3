//! Whether a rule file changed on disk since it was last read, by its
//! modification time (the daemon's `watch: true`, `limiter proxy --watch`).

use std::{
    path::{Path, PathBuf},
    time::SystemTime,
};

pub struct FileWatch {
    path: PathBuf,
    seen: Option<SystemTime>,
}

impl FileWatch {
    /// Watches `path`, as it is now.
    pub fn new(path: &Path) -> Self {
        Self {
            path: path.to_owned(),
            seen: modified(path),
        }
    }

    /// Whether it changed since the last call (or [`FileWatch::read`]).
    pub fn changed(&mut self) -> bool {
        let now = modified(&self.path);
        let changed = now != self.seen;
        self.seen = now;
        changed
    }

    /// It was read (for another reason, a signal): only later changes count.
    pub fn read(&mut self) {
        self.seen = modified(&self.path);
    }
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}
