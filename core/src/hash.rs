//! The workspace's one hash, xxh3, in its 64- and 128-bit forms.
//!
//! Its values outlive a process: they check WAL records, spill files, cache shards and every
//! transfer, name objects and fingerprints, and place rows in hash partitions. So every crate
//! hashes through this module, and its tests pin the values to the reference algorithm's:
//! changing the implementation behind it must change no hash.
//!
//! The implementation is `xxhash-rust`'s. `twox-hash`, whose AVX2 kernel hashes long inputs
//! about 1.7 times as fast, was tried (BENCHMARKS.md, session 26): no workload moved beyond
//! its noise, and its generic streaming code, instantiated here, ran 26 times slower in the
//! unoptimized builds the tests use, enough for spilling nodes to miss their heartbeats.

/// How many bytes to copy before hashing them, where bytes are copied and hashed in one pass:
/// small enough that the piece is still in a core's L1 cache (32 KiB or more on today's x86
/// cores) when it is hashed, large enough that the calls cost nothing. Copying and hashing 48
/// MiB in 12 MiB writes took 8.3–8.7 ms in steps of 8 KiB against 14.2–14.6 ms a write at a
/// time (release, a 2-core Intel Xeon VM).
pub const STEP_BYTES: usize = 8 << 10;

/// The xxh3-64 of `bytes`.
pub fn xxh3_64(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// The xxh3-128 of `bytes`.
pub fn xxh3_128(bytes: &[u8]) -> u128 {
    xxhash_rust::xxh3::xxh3_128(bytes)
}

/// A hasher of bytes given in pieces, whose digest is the one-shot hash of them joined.
macro_rules! streaming_hasher {
    ($(#[$doc:meta])* $name:ident -> $digest:ty, $finish:ident) => {
        $(#[$doc])*
        #[derive(Clone)]
        pub struct $name(xxhash_rust::xxh3::Xxh3Default);

        impl $name {
            pub fn new() -> Self {
                Self(xxhash_rust::xxh3::Xxh3Default::new())
            }

            pub fn update(&mut self, bytes: &[u8]) {
                self.0.update(bytes);
            }

            /// The hash of everything given so far (the hasher can go on).
            pub fn digest(&self) -> $digest {
                self.0.$finish()
            }
        }

        impl Default for $name {
            fn default() -> Self {
                Self::new()
            }
        }

        impl std::fmt::Debug for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(stringify!($name))
            }
        }
    };
}

streaming_hasher!(
    /// An xxh3-64 of bytes given in pieces: the same value as [`xxh3_64`] of them joined.
    Xxh3_64 -> u64, digest
);

streaming_hasher!(
    /// An xxh3-128 of bytes given in pieces: the same value as [`xxh3_128`] of them joined.
    Xxh3_128 -> u128, digest128
);

impl Xxh3_64 {
    /// Starts again, as if new.
    pub fn reset(&mut self) {
        self.0.reset();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes that are not a repeat of a short pattern, so every lane of the kernels differs.
    fn input(len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| u8::try_from((i * 31 + 7) % 251).unwrap_or(0))
            .collect()
    }

    /// The reference algorithm's values (xxHash's own for the empty input; the others agreed
    /// by `xxhash-rust` and `twox-hash`, two implementations), at every length where xxh3
    /// changes its code path: 0, 1–3, 4–8, 9–16, 17–128, 129–240, then striped blocks.
    /// Hashes written by earlier builds (WAL records, spill files, shards) must still verify.
    const REFERENCE: [(usize, u64, u128); 15] = [
        (0, 0x2d06800538d394c2, 0x99aa06d3014798d86001c324468d497f),
        (1, 0x4c5cca45d0f4811f, 0x495b62073ef70ca44c5cca45d0f4811f),
        (3, 0x15f7093b173d005c, 0x46f66cb93538156515f7093b173d005c),
        (4, 0xdca012f95811b6b9, 0x7fefeeffb4d0eab3b987ca5d9241572a),
        (8, 0xdec6a9a43575982e, 0x803c675a846cc6c256bb836ceb6d4baa),
        (9, 0x15e553b97e27735d, 0x365644c233ffe5c213af585c9bf5827d),
        (16, 0xa7683b861e585aa6, 0xda917c385cc874c00d463cb04ceffbaf),
        (17, 0x637c1aa907698945, 0xd443578f2c4e2fb495c34448580e19c8),
        (128, 0x6d0f64c82ddaad27, 0x22c34350373a38ae5b77925b2c683a12),
        (129, 0xeaf3fc97c05f44f3, 0xc4a7d8f7893f2090d6d9e73553568be1),
        (240, 0x22f28cbbfaf0447f, 0xe29d70b8920fd24bc6ed4333f79384f8),
        (241, 0x07525dbc14902c7f, 0xf91b3cb8ed0fa91a07525dbc14902c7f),
        (1024, 0xe2898655db7bc9ee, 0xf53a1b1e9f1efedfe2898655db7bc9ee),
        (
            65_543,
            0xfea72e2fe49764e3,
            0x3a7f00e456967239fea72e2fe49764e3,
        ),
        (
            1_048_583,
            0x32fa32363a6c3da3,
            0x7cbf159e4bfdf7e432fa32363a6c3da3,
        ),
    ];

    #[test]
    fn hashes_are_the_reference_algorithms_whole_or_in_pieces() {
        for (len, expected_64, expected_128) in REFERENCE {
            let bytes = input(len);
            assert_eq!(xxh3_64(&bytes), expected_64, "xxh3-64 of {len} bytes");
            assert_eq!(xxh3_128(&bytes), expected_128, "xxh3-128 of {len} bytes");
            // Pieces of odd sizes cross the streaming hashers' internal buffers at every
            // offset.
            for piece in [1, 7, 1000, 8192] {
                let mut streamed_64 = Xxh3_64::new();
                let mut streamed_128 = Xxh3_128::new();
                for chunk in bytes.chunks(piece) {
                    streamed_64.update(chunk);
                    streamed_128.update(chunk);
                }
                assert_eq!(streamed_64.digest(), expected_64, "{len} bytes by {piece}");
                assert_eq!(
                    streamed_128.digest(),
                    expected_128,
                    "{len} bytes by {piece}"
                );
            }
        }
    }

    #[test]
    fn a_reset_hasher_starts_again() {
        let mut hasher = Xxh3_64::new();
        hasher.update(b"not this");
        hasher.reset();
        hasher.update(b"abc");
        assert_eq!(hasher.digest(), xxh3_64(b"abc"));
    }
}
