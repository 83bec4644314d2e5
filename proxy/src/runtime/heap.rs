//! Giving freed heap back to the operating system after a large resync.
//!
//! Applying a snapshot of many blocks grows the index's tables by doubling; glibc's
//! allocator keeps the tables they outgrew (and the decoded parts of the reply) as free
//! heap inside the process, so the resident set stayed up to 1.8 times the index's own
//! bytes after a 100,000-block resync. `malloc_trim` hands those free pages back. It walks
//! every arena, so the intake calls it off the async threads and only once the large
//! resyncs in flight are all applied.

/// Returns the process's free heap pages to the operating system (glibc); a no-op with
/// other C libraries, whose allocators return memory on their own terms.
pub(crate) fn release_free_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let started = std::time::Instant::now();
        // SAFETY: `malloc_trim` takes a byte count to keep free at the heap's top and only
        // returns free pages; it touches no memory the program holds.
        let released = unsafe { libc::malloc_trim(0) };
        tracing::debug!(
            released = released != 0,
            took_us = started.elapsed().as_micros() as u64,
            "returned free heap to the operating system"
        );
    }
}
