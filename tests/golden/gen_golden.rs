//! Prints the golden layout table that tests/test_golden.py checks gdn_layout against.
//!
//! Every number comes from the seed's own `GdnBackwardLayout` (built next to this file as
//! `gdn.rs`), so the table is what rlx-ir computes, not a re-derivation. Build it without -O or
//! with `-C overflow-checks=on`: a configuration is recorded as overflowing exactly when one of
//! the seed's methods panics on usize arithmetic, as a debug build of rlx-ir would.

mod gdn;

use gdn::GdnBackwardLayout;
use std::fmt::Write as _;
use std::panic::{self, AssertUnwindSafe};

const SOURCE: &str = "rlx-ir 0.2.16 src/gdn.rs";
const GENERATOR: &str = "tests/golden/gen_golden.rs";
const PRNG: &str = "splitmix64";
const PRNG_SEED: u64 = 0x6764_6e5f_6c61_796f;
const RANDOM_CONFIGS: usize = 200;

const MAX: usize = usize::MAX;
const P63: usize = 1 << 63;

/// splitmix64: tiny, well mixed, and trivially reproducible without crates.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// In `0..n`; the modulo bias is irrelevant for picking test cases.
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// A value with exactly `k` significant bits (0 when `k == 0`).
    fn with_bits(&mut self, k: u32) -> u64 {
        if k == 0 {
            return 0;
        }
        let top = 1u64 << (k - 1);
        top | (self.next() & (top - 1))
    }

    /// One dimension, anywhere from realistic to absurd, so that small and huge mix.
    fn dim(&mut self) -> usize {
        let v = match self.below(8) {
            0..=2 => self.below(17),
            3 => 1 + self.below(4096),
            4 => 1 << self.below(64),
            5 => {
                // Straddle a power of two, where off-by-one overflow bugs live.
                let p = 1u64 << self.below(64);
                if self.below(2) == 0 {
                    p - 1
                } else {
                    p + 1
                }
            }
            6 => {
                let k = 1 + self.below(64) as u32;
                self.with_bits(k)
            }
            _ => self.next(),
        };
        v as usize
    }

    /// Four non-zero dims whose product has between `total_bits - 3` and `total_bits` bits,
    /// so that products and totals land near 2**63 and 2**64 instead of far past them.
    fn dims_near(&mut self, total_bits: u32) -> [usize; 4] {
        let mut bits = [1u32; 4];
        for _ in 4..total_bits {
            let i = self.below(4) as usize;
            if bits[i] < 64 {
                bits[i] += 1;
            }
        }
        bits.map(|k| self.with_bits(k) as usize)
    }
}

struct Row {
    qkv_elems: usize,
    beta_elems: usize,
    gate_elems: usize,
    state_elems: usize,
    dq_offset: usize,
    dk_offset: usize,
    dv_offset: usize,
    dg_offset: usize,
    dbeta_offset: usize,
    dstate_offset: usize,
    total_elems: usize,
    slices: Vec<(usize, usize)>,
}

/// Every public quantity of the seed, or None when any of them overflows usize.
fn evaluate(l: &GdnBackwardLayout) -> Option<Row> {
    let result = panic::catch_unwind(AssertUnwindSafe(|| Row {
        qkv_elems: l.qkv_elems(),
        beta_elems: l.beta_elems(),
        gate_elems: l.gate_elems(),
        state_elems: l.state_elems(),
        dq_offset: l.dq_offset(),
        dk_offset: l.dk_offset(),
        dv_offset: l.dv_offset(),
        dg_offset: l.dg_offset(),
        dbeta_offset: l.dbeta_offset(),
        dstate_offset: l.dstate_offset(),
        total_elems: l.total_elems(),
        slices: l.slices(),
    }));
    match result {
        Ok(row) => Some(row),
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            // Only arithmetic overflow is an expected outcome; anything else means the seed
            // changed behaviour and the table must not be written.
            if !msg.contains("overflow") {
                eprintln!("unexpected panic for {l:?}: {msg}");
                std::process::exit(1);
            }
            None
        }
    }
}

fn edge_cases() -> Vec<(&'static str, [usize; 4])> {
    vec![
        ("all-zero", [0, 0, 0, 0]),
        ("batch-zero", [0, 3, 4, 8]),
        ("seq-zero", [2, 0, 4, 8]),
        ("heads-zero", [2, 3, 0, 8]),
        ("state-size-zero", [2, 3, 4, 0]),
        ("all-ones", [1, 1, 1, 1]),
        ("rlx-test-config", [2, 3, 4, 8]),
        ("rlx-test-config", [2, 5, 3, 8]),
        ("large-n", [1, 1, 1, 128]),
        ("large-n", [2, 3, 4, 128]),
        ("large-n", [8, 4096, 32, 128]),
        ("large-n", [1, 1, 1, 256]),
        // Totals straddling 2**63: 3n + 2 with n = (2**63 - 2) / 3 is exactly 2**63.
        ("total-below-2p63", [1, 1, 1, (P63 - 2) / 3 - 1]),
        ("total-at-2p63", [1, 1, 1, (P63 - 2) / 3]),
        ("total-above-2p63", [1, 1, 1, (P63 - 2) / 3 + 1]),
        // qkv straddling 2**63: 2 * qkv and 3 * qkv overflow here.
        ("qkv-below-2p63", [1, 1, 1, P63 - 1]),
        ("qkv-at-2p63", [1 << 21, 1 << 21, 1 << 21, 1]),
        ("qkv-above-2p63", [1, 1, 1, P63 + 1]),
        // qkv = 2**62: 3 * qkv fits, the per-channel gate pushes dbeta_offset to 2**64.
        ("qkv-2p62", [1 << 20, 1 << 20, 1 << 20, 4]),
        // Totals just below 2**64: 5 * ((2**64 - 1) / 5) is exactly usize::MAX.
        ("total-usize-max", [MAX / 5, 1, 1, 1]),
        ("total-past-usize-max", [MAX / 5 + 1, 1, 1, 1]),
        ("total-below-2p64-carry", [MAX / 6, 1, 1, 1]),
        // 3 * qkv right at usize::MAX, so the overflow comes from the later additions.
        ("dg-offset-below-max", [1, 1, 1, MAX / 3 - 1]),
        ("dg-offset-at-max", [1, 1, 1, MAX / 3]),
        ("bsh-near-2p63", [MAX / 2, 1, 1, 0]),
        ("bsh-usize-max", [MAX, 1, 1, 0]),
        ("huge-dim-rest-zero", [MAX, 0, 0, 0]),
        ("huge-dim-rest-zero", [0, 0, 0, MAX]),
        ("huge-batch", [MAX, 1, 1, 1]),
        ("huge-state-size", [1, 1, 1, MAX]),
        ("all-max", [MAX, MAX, MAX, MAX]),
        ("max-max-zero", [MAX, MAX, 0, 0]),
        // The final product is 0 or fits, but a left-to-right partial product does not.
        ("intermediate-overflow", [1 << 40, 1 << 40, 0, 8]),
        ("intermediate-overflow", [1 << 40, 1 << 40, 0, 0]),
        ("intermediate-overflow", [1, 1 << 40, 1 << 40, 0]),
        ("intermediate-overflow", [1 << 32, 1 << 32, 0, 5]),
        ("intermediate-fits", [(1 << 32) - 1, (1 << 32) + 1, 0, 1]),
        // Only the carried state [B, H, N, N] overflows.
        ("state-only-overflow", [1 << 40, 0, 1 << 40, 0]),
        ("state-only-overflow", [1, 0, 1, 1 << 32]),
        ("state-fits", [1, 0, 1, (1 << 32) - 1]),
        ("state-total-overflow", [1, 1, 1, (1 << 32) - 1]),
    ]
}

fn push_case(out: &mut String, label: &str, dims: [usize; 4], gate: bool, carry: bool) {
    let [b, s, h, n] = dims;
    let l = GdnBackwardLayout::new(b, s, h, n, gate, carry);
    write!(
        out,
        "{{\"label\": \"{label}\", \"batch\": {b}, \"seq\": {s}, \"heads\": {h}, \
         \"state_size\": {n}, \"gate_per_channel\": {gate}, \"carry_state\": {carry}, "
    )
    .unwrap();
    match evaluate(&l) {
        None => out.push_str("\"overflow\": true}"),
        Some(r) => {
            let slices: Vec<String> =
                r.slices.iter().map(|(o, len)| format!("[{o}, {len}]")).collect();
            write!(
                out,
                "\"qkv_elems\": {}, \"beta_elems\": {}, \"gate_elems\": {}, \
                 \"state_elems\": {}, \"dq_offset\": {}, \"dk_offset\": {}, \
                 \"dv_offset\": {}, \"dg_offset\": {}, \"dbeta_offset\": {}, \
                 \"dstate_offset\": {}, \"total_elems\": {}, \"slices\": [{}]}}",
                r.qkv_elems,
                r.beta_elems,
                r.gate_elems,
                r.state_elems,
                r.dq_offset,
                r.dk_offset,
                r.dv_offset,
                r.dg_offset,
                r.dbeta_offset,
                r.dstate_offset,
                r.total_elems,
                slices.join(", ")
            )
            .unwrap();
        }
    }
}

fn main() {
    // The table is for the 64-bit targets RLX runs on; elsewhere the numbers would differ.
    assert_eq!(usize::BITS, 64, "golden vectors assume a 64-bit usize");
    // Overflow panics are expected outcomes here, not errors worth a backtrace each.
    panic::set_hook(Box::new(|_| {}));

    let mut configs: Vec<(&'static str, [usize; 4])> = edge_cases();
    let mut rng = SplitMix64(PRNG_SEED);
    for i in 0..RANDOM_CONFIGS {
        let dims = if i % 2 == 0 {
            [rng.dim(), rng.dim(), rng.dim(), rng.dim()]
        } else {
            let bits = 58 + rng.below(10) as u32;
            rng.dims_near(bits)
        };
        configs.push(("random", dims));
    }

    let mut cases = Vec::new();
    for (label, dims) in &configs {
        for gate in [false, true] {
            for carry in [false, true] {
                let mut line = String::new();
                push_case(&mut line, label, *dims, gate, carry);
                cases.push(line);
            }
        }
    }

    println!(
        "{{\"source\": \"{SOURCE}\", \"generator\": \"{GENERATOR}\", \
         \"prng\": {{\"algorithm\": \"{PRNG}\", \"seed\": {PRNG_SEED}}}, \
         \"random_configs\": {RANDOM_CONFIGS}, \"cases\": ["
    );
    println!("{}", cases.join(",\n"));
    println!("]}}");
}
