//! Result rows, the table and the JSON file.

use std::fmt::Write as _;
use std::path::Path;

use mla_decode::DeviceInfo;

use super::cases::Meta;
use super::check::Accuracy;
use super::gpu::FlushMode;

/// Suffix of the rows measured with `PlanOptions { sm120_occupancy: true }`.
pub const SM120_SUFFIX: &str = " [sm120-occ]";

/// A row's name: the case's, with [`SM120_SUFFIX`] for the sm_120-occupancy run.
pub fn row_name(case: &str, sm120_occupancy: bool) -> String {
    if sm120_occupancy {
        format!("{case}{SM120_SUFFIX}")
    } else {
        case.to_string()
    }
}

/// One measured case.
#[derive(Clone, Debug)]
pub struct Row {
    pub meta: Meta,
    pub sm120_occupancy: bool,
    /// Median µs of a step launched from the host.
    pub us: f64,
    /// Median µs of a CUDA-graph replay of the step.
    pub graph_us: Option<f64>,
    pub accuracy: Option<Accuracy>,
    /// The device's copy bandwidth, GB/s.
    pub copy_gbps: f64,
}

impl Row {
    pub fn name(&self) -> String {
        row_name(&self.meta.name, self.sm120_occupancy)
    }

    pub fn gbps(&self) -> f64 {
        self.meta.bytes / self.us / 1e3
    }

    pub fn pct_of_copy(&self) -> f64 {
        100.0 * self.gbps() / self.copy_gbps
    }

    pub fn tflops(&self) -> f64 {
        self.meta.flop / self.us / 1e6
    }

    /// Whether the check (if any) passed.
    pub fn passed(&self) -> bool {
        self.accuracy.is_none_or(|a| a.passed())
    }

    /// How the runs kept the inputs out of L2: `rotate` over `copies` copies of the KV
    /// cache, or `memset` before each run.
    pub fn l2(&self) -> &'static str {
        if self.meta.copies.is_some() {
            "rotate"
        } else {
            "memset"
        }
    }

    /// The table's L2 column: `rot R` or `memset`.
    pub fn l2_label(&self) -> String {
        match self.meta.copies {
            Some(r) => format!("rot {r}"),
            None => "memset".into(),
        }
    }
}

/// Fixed-width table lines.
pub struct Table {
    width: usize,
    check: bool,
}

impl Table {
    /// A table whose name column fits `names`; `check` adds the accuracy columns.
    pub fn new(names: impl IntoIterator<Item = String>, check: bool) -> Table {
        let width = names.into_iter().map(|n| n.len()).max().unwrap_or(0);
        Table {
            width: width.max(4),
            check,
        }
    }

    pub fn header(&self) -> String {
        let mut line = format!(
            "{:<w$}  {:>10}  {:>10}  {:>7}  {:>7}  {:>8}  {:>7}",
            "case",
            "µs",
            "graph µs",
            "GB/s",
            "% copy",
            "TFLOP/s",
            "L2",
            w = self.width
        );
        if self.check {
            let _ = write!(line, "  {:>9}  {:>9}  {:>5}", "relerr", "lse_err", "check");
        }
        line
    }

    pub fn line(&self, row: &Row) -> String {
        let tflops = if row.meta.flop > 0.0 {
            format!("{:.2}", row.tflops())
        } else {
            "-".into()
        };
        let mut line = format!(
            "{:<w$}  {:>10.2}  {:>10}  {:>7.0}  {:>6.1}%  {:>8}  {:>7}",
            row.name(),
            row.us,
            row.graph_us.map_or("-".into(), |g| format!("{g:.2}")),
            row.gbps(),
            row.pct_of_copy(),
            tflops,
            row.l2_label(),
            w = self.width
        );
        if self.check {
            let _ = match &row.accuracy {
                Some(a) => write!(
                    line,
                    "  {:>9.2e}  {:>9}  {:>5}",
                    a.relerr,
                    a.lse_err.map_or("-".into(), |e| format!("{e:.2e}")),
                    if a.passed() { "ok" } else { "FAIL" }
                ),
                None => write!(line, "  {:>9}  {:>9}  {:>5}", "-", "-", "-"),
            };
        }
        line
    }

    pub fn print(&self, rows: &[Row]) {
        println!("{}", self.header());
        for row in rows {
            println!("{}", self.line(row));
        }
    }
}

/// Writes `{"device", "arch", "sm_count", "l2_bytes", "copy_gbps", "l2", "rows": [...]}`;
/// `"l2"` is the `--flush` mode asked for (a row's own `"l2"` says what its runs did).
pub fn write_json(
    path: &Path,
    info: &DeviceInfo,
    copy_gbps: f64,
    flush: FlushMode,
    rows: &[Row],
) -> std::io::Result<()> {
    let rows: Vec<String> = rows
        .iter()
        .map(|r| format!("    {}", row_json(r)))
        .collect();
    let text = format!(
        "{{\n  \"device\": {},\n  \"arch\": {},\n  \"sm_count\": {},\n  \"l2_bytes\": {},\n  \"copy_gbps\": {},\n  \"l2\": {},\n  \"rows\": [\n{}\n  ]\n}}\n",
        quote(&info.name),
        quote(&info.sm_name()),
        info.sm_count,
        info.l2_cache_bytes,
        number(copy_gbps),
        quote(flush.name()),
        rows.join(",\n")
    );
    std::fs::write(path, text)
}

fn row_json(r: &Row) -> String {
    let m = &r.meta;
    let text_or_null = |s: Option<&str>| s.map_or("null".to_string(), quote);
    let mut fields = vec![
        ("name", quote(&r.name())),
        ("kind", quote(m.kind)),
        ("dtype", text_or_null(m.dtype.map(|d| d.name()))),
        ("kv_format", text_or_null(m.kv_format)),
        ("scale_rule", text_or_null(m.scale_rule)),
        ("batch", m.batch.to_string()),
        ("q_len", m.q_len.to_string()),
        ("heads", m.heads.to_string()),
        ("seq_len", m.seq_len.to_string()),
        ("topk", m.topk.to_string()),
        ("lens", text_or_null(m.lens.as_deref())),
        ("block_size", m.block_size.to_string()),
        ("us", number(r.us)),
        ("graph_us", r.graph_us.map_or("null".into(), number)),
        ("gbps", number(r.gbps())),
        ("pct_of_copy", number(r.pct_of_copy())),
        ("tflops", number(r.tflops())),
        ("bytes", number(m.bytes)),
        ("flop", number(m.flop)),
        ("sm120_occupancy", r.sm120_occupancy.to_string()),
        // rotated over `copies` copies of the cache, or flushed by the memset (1 copy)
        ("l2", quote(r.l2())),
        ("copies", m.copies.unwrap_or(1).to_string()),
    ];
    if let Some(a) = &r.accuracy {
        fields.push(("relerr", number(a.relerr)));
        if let Some(e) = a.lse_err {
            fields.push(("lse_err", number(e)));
        }
    }
    let body: Vec<String> = fields
        .iter()
        .map(|(k, v)| format!("{}: {v}", quote(k)))
        .collect();
    format!("{{{}}}", body.join(", "))
}

/// A JSON number (`null` for NaN and infinities, which JSON cannot spell).
fn number(v: f64) -> String {
    if v.is_finite() {
        format!("{v}")
    } else {
        "null".into()
    }
}

/// A JSON string.
fn quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}
