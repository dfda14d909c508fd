//! A minimal hand-written SVG toolkit for the HTML report: scales (linear, log),
//! "nice" ticks, axes with grid and labels, legends, and escaping. No plotting crate.

use super::format::fmt_sig;
use std::fmt::Write;

/// Escape text for HTML/SVG text nodes and attribute values.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for ch in s.chars() {
        match ch {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Colour-blind-friendly palette (Okabe-Ito, then Tableau extras), all readable on white.
pub const PALETTE: &[&str] = &[
    "#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#7F7F7F", "#8C564B",
    "#17BECF", "#BCBD22", "#1F3A93", "#A50026",
];

/// Colour of the `i`-th series.
pub fn colour(i: usize) -> &'static str {
    PALETTE[i % PALETTE.len()]
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ScaleKind {
    Linear,
    /// Logarithmic with ticks at powers of 2 (labels such as 512, 1k, 16k).
    Log2,
    /// Logarithmic with ticks at 1-2-5 × powers of 10.
    Log10,
}

/// Maps a data domain [d0, d1] to a pixel range [r0, r1] (r1 < r0 for a y axis).
#[derive(Debug, Clone, Copy)]
pub struct Scale {
    pub kind: ScaleKind,
    pub d0: f64,
    pub d1: f64,
    pub r0: f64,
    pub r1: f64,
}

fn tf(kind: ScaleKind, v: f64) -> f64 {
    match kind {
        ScaleKind::Linear => v,
        ScaleKind::Log2 => v.max(f64::MIN_POSITIVE).log2(),
        ScaleKind::Log10 => v.max(f64::MIN_POSITIVE).log10(),
    }
}

impl Scale {
    /// A scale over the data values `vals` (non-finite and, for log scales, non-positive
    /// values ignored), padded so points do not sit on the frame. `include` values
    /// (e.g. 0 or 1.0) are forced into the domain.
    pub fn fit(kind: ScaleKind, vals: &[f64], include: &[f64], r0: f64, r1: f64) -> Scale {
        let ok = |v: &f64| v.is_finite() && (kind == ScaleKind::Linear || *v > 0.0);
        let all: Vec<f64> = vals.iter().chain(include).copied().filter(ok).collect();
        let (mut lo, mut hi) = all
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &v| {
                (a.min(v), b.max(v))
            });
        if !lo.is_finite() {
            (lo, hi) = if kind == ScaleKind::Linear {
                (0.0, 1.0)
            } else {
                (1.0, 10.0)
            };
        }
        match kind {
            ScaleKind::Linear => {
                let (mut l, mut h) = (lo, hi);
                if h <= l {
                    let d = l.abs().max(1e-9) * 0.1;
                    l -= d;
                    h += d;
                }
                let pad = (h - l) * 0.06;
                let l = if include.contains(&0.0) && lo >= 0.0 {
                    0.0
                } else {
                    l - pad
                };
                let h = h + pad;
                let step = nice_step((h - l) / 5.0);
                lo = (l / step).floor() * step;
                hi = (h / step).ceil() * step;
            }
            ScaleKind::Log2 => {
                lo = 2f64.powf(lo.log2().floor());
                hi = 2f64.powf(hi.log2().ceil());
                if hi <= lo {
                    lo /= 2.0;
                    hi *= 2.0;
                }
            }
            ScaleKind::Log10 => {
                let (l, h) = (lo.log10(), hi.log10());
                let span = (h - l).max(0.3);
                let mid = (h + l) / 2.0;
                let (l, h) = (
                    mid - span / 2.0 - 0.08 * span,
                    mid + span / 2.0 + 0.08 * span,
                );
                lo = 10f64.powf(l);
                hi = 10f64.powf(h);
            }
        }
        Scale {
            kind,
            d0: lo,
            d1: hi,
            r0,
            r1,
        }
    }

    /// Pixel position of `v`.
    pub fn map(&self, v: f64) -> f64 {
        let (a, b, x) = (
            tf(self.kind, self.d0),
            tf(self.kind, self.d1),
            tf(self.kind, v),
        );
        let t = if b != a { (x - a) / (b - a) } else { 0.5 };
        self.r0 + t * (self.r1 - self.r0)
    }

    pub fn contains(&self, v: f64) -> bool {
        let (lo, hi) = (self.d0.min(self.d1), self.d0.max(self.d1));
        v >= lo * (1.0 - 1e-9) && v <= hi * (1.0 + 1e-9) + 1e-300
    }

    /// Tick positions and labels inside the domain.
    pub fn ticks(&self) -> Vec<(f64, String)> {
        let (lo, hi) = (self.d0.min(self.d1), self.d0.max(self.d1));
        match self.kind {
            ScaleKind::Linear => {
                let step = nice_step((hi - lo) / 5.0);
                let mut t = (lo / step).ceil() * step;
                let mut out = Vec::new();
                while t <= hi + step * 1e-9 && out.len() < 50 {
                    let v = if t.abs() < step * 1e-9 { 0.0 } else { t };
                    out.push((v, fmt_tick(v, step)));
                    t += step;
                }
                out
            }
            ScaleKind::Log2 => {
                let (a, b) = (lo.log2().ceil() as i32, hi.log2().floor() as i32);
                let every = ((b - a) / 10 + 1).max(1);
                (a..=b)
                    .filter(|k| (k - a) % every == 0)
                    .map(|k| {
                        let v = 2f64.powi(k);
                        (v, fmt_pow2(v))
                    })
                    .collect()
            }
            ScaleKind::Log10 => {
                let (a, b) = (lo.log10().floor() as i32, hi.log10().ceil() as i32);
                let mults: &[f64] = if b - a >= 3 { &[1.0] } else { &[1.0, 2.0, 5.0] };
                let mut out = Vec::new();
                for k in a..=b {
                    for &m in mults {
                        let v = m * 10f64.powi(k);
                        if v >= lo * (1.0 - 1e-9) && v <= hi * (1.0 + 1e-9) {
                            out.push((v, fmt_plain(v)));
                        }
                    }
                }
                if out.len() < 2 {
                    // Very narrow range: fall back to end points.
                    out = vec![(lo, fmt_plain(lo)), (hi, fmt_plain(hi))];
                }
                out
            }
        }
    }
}

/// A step of 1, 2 or 5 × 10^k close to `raw`.
pub fn nice_step(raw: f64) -> f64 {
    if !(raw.is_finite() && raw > 0.0) {
        return 1.0;
    }
    let mag = 10f64.powf(raw.log10().floor());
    let f = raw / mag;
    let m = if f < 1.5 {
        1.0
    } else if f < 3.5 {
        2.0
    } else if f < 7.5 {
        5.0
    } else {
        10.0
    };
    m * mag
}

fn fmt_tick(v: f64, step: f64) -> String {
    if v == 0.0 {
        return "0".to_string();
    }
    let decimals = if step >= 1.0 {
        0
    } else {
        (-step.log10().floor()) as usize
    };
    if v.abs() >= 1e6 || v.abs() < 1e-4 {
        return format!("{v:.1e}");
    }
    format!("{v:.decimals$}")
}

/// A number with up to 3 significant digits and no trailing zeros (0.5, 2, 1000).
pub fn fmt_plain(v: f64) -> String {
    let s = fmt_sig(v, 3);
    if s.contains('.') && !s.contains('e') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// Powers of two as 512, 1k, 2k ... 1M.
pub fn fmt_pow2(v: f64) -> String {
    if v >= 1048576.0 && (v / 1048576.0).fract() == 0.0 {
        format!("{}M", v / 1048576.0)
    } else if v >= 1024.0 && (v / 1024.0).fract() == 0.0 {
        format!("{}k", v / 1024.0)
    } else {
        fmt_plain(v)
    }
}

/// Plot frame: outer size and the inner plotting rectangle.
#[derive(Debug, Clone, Copy)]
pub struct Frame {
    pub width: f64,
    pub height: f64,
    pub left: f64,
    pub right: f64,
    pub top: f64,
    pub bottom: f64,
}

impl Frame {
    pub fn x0(&self) -> f64 {
        self.left
    }
    pub fn x1(&self) -> f64 {
        self.width - self.right
    }
    pub fn y0(&self) -> f64 {
        self.height - self.bottom
    }
    pub fn y1(&self) -> f64 {
        self.top
    }
}

/// Opening `<svg>` tag with a title for accessibility.
pub fn open(w: f64, h: f64, title: &str) -> String {
    format!(
        "<svg class=\"plot\" width=\"{w:.0}\" height=\"{h:.0}\" \
         viewBox=\"0 0 {w:.0} {h:.0}\" role=\"img\" aria-label=\"{t}\"><title>{t}</title>\n",
        t = esc(title)
    )
}

pub fn close() -> &'static str {
    "</svg>\n"
}

/// Text element; `anchor` is start, middle or end.
pub fn text(x: f64, y: f64, s: &str, anchor: &str, class: &str) -> String {
    format!(
        "<text x=\"{x:.1}\" y=\"{y:.1}\" text-anchor=\"{anchor}\" class=\"{class}\">{}</text>",
        esc(s)
    )
}

pub fn line(x1: f64, y1: f64, x2: f64, y2: f64, style: &str) -> String {
    format!("<line x1=\"{x1:.1}\" y1=\"{y1:.1}\" x2=\"{x2:.1}\" y2=\"{y2:.1}\" {style}/>")
}

/// Axes, grid lines, ticks, tick labels and axis titles for `x` and `y` in `f`.
pub fn axes(f: &Frame, x: &Scale, y: &Scale, x_title: &str, y_title: &str) -> String {
    let mut s = String::new();
    let _ = write!(
        s,
        "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" class=\"frame\"/>",
        f.x0(),
        f.y1(),
        f.x1() - f.x0(),
        f.y0() - f.y1()
    );
    for (v, label) in x.ticks() {
        let px = x.map(v);
        s.push_str(&line(px, f.y1(), px, f.y0(), "class=\"grid\""));
        s.push_str(&line(px, f.y0(), px, f.y0() + 5.0, "class=\"tick\""));
        s.push_str(&text(px, f.y0() + 18.0, &label, "middle", "ticklabel"));
    }
    for (v, label) in y.ticks() {
        let py = y.map(v);
        s.push_str(&line(f.x0(), py, f.x1(), py, "class=\"grid\""));
        s.push_str(&line(f.x0() - 5.0, py, f.x0(), py, "class=\"tick\""));
        s.push_str(&text(f.x0() - 8.0, py + 4.0, &label, "end", "ticklabel"));
    }
    s.push_str(&text(
        (f.x0() + f.x1()) / 2.0,
        f.height - 8.0,
        x_title,
        "middle",
        "axislabel",
    ));
    let (cx, cy) = (14.0, (f.y0() + f.y1()) / 2.0);
    let _ = writeln!(
        s,
        "<text x=\"{cx:.1}\" y=\"{cy:.1}\" text-anchor=\"middle\" class=\"axislabel\" \
         transform=\"rotate(-90 {cx:.1} {cy:.1})\">{}</text>",
        esc(y_title)
    );
    s
}

/// A vertical legend starting at (x, y): one coloured swatch and label per item.
pub fn legend(x: f64, y: f64, items: &[(String, &str)], max_chars: usize) -> String {
    let mut s = String::new();
    for (i, (label, col)) in items.iter().enumerate() {
        let yy = y + i as f64 * 18.0;
        let _ = write!(
            s,
            "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"12\" height=\"12\" rx=\"2\" fill=\"{col}\"/>",
            yy - 10.0
        );
        let shown = super::format::truncate(label, max_chars);
        let _ = write!(
            s,
            "<text x=\"{:.1}\" y=\"{yy:.1}\" class=\"legend\"><title>{}</title>{}</text>",
            x + 17.0,
            esc(label),
            esc(&shown)
        );
    }
    s.push('\n');
    s
}

/// Polyline through points (already in pixels).
pub fn polyline(points: &[(f64, f64)], colour: &str, extra: &str) -> String {
    let pts: Vec<String> = points
        .iter()
        .map(|(x, y)| format!("{x:.1},{y:.1}"))
        .collect();
    format!(
        "<polyline points=\"{}\" fill=\"none\" stroke=\"{colour}\" stroke-width=\"2\" {extra}/>",
        pts.join(" ")
    )
}

/// A hollow marker (white fill, coloured ring) with a hover tooltip.
pub fn ring(x: f64, y: f64, r: f64, colour: &str, tooltip: &str) -> String {
    format!(
        "<circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"{r}\" fill=\"#fff\" stroke=\"{colour}\" \
         stroke-width=\"2\"><title>{}</title></circle>",
        esc(tooltip)
    )
}

/// A marker with a hover tooltip.
pub fn circle(x: f64, y: f64, r: f64, colour: &str, tooltip: &str) -> String {
    format!(
        "<circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"{r}\" fill=\"{colour}\"><title>{}</title></circle>",
        esc(tooltip)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping() {
        assert_eq!(
            esc("<script>a&b\"'</script>"),
            "&lt;script&gt;a&amp;b&quot;&#39;&lt;/script&gt;"
        );
    }

    #[test]
    fn linear_scale_includes_zero_and_nice_ticks() {
        let s = Scale::fit(ScaleKind::Linear, &[3.0, 47.0], &[0.0], 0.0, 100.0);
        assert_eq!(s.d0, 0.0);
        assert!(s.d1 >= 47.0);
        let t = s.ticks();
        assert!(t.len() >= 3 && t.len() <= 12, "{t:?}");
        assert_eq!(t[0].1, "0");
        assert_eq!(s.map(0.0), 0.0);
    }

    #[test]
    fn log2_scale_single_point() {
        let s = Scale::fit(ScaleKind::Log2, &[4096.0], &[], 0.0, 100.0);
        assert!(s.d0 < 4096.0 && s.d1 > 4096.0);
        let labels: Vec<String> = s.ticks().into_iter().map(|t| t.1).collect();
        assert!(labels.contains(&"4k".to_string()), "{labels:?}");
        assert!((s.map(4096.0) - 50.0).abs() < 1e-9);
    }

    #[test]
    fn log10_ticks() {
        let s = Scale::fit(ScaleKind::Log10, &[0.5, 800.0], &[], 0.0, 100.0);
        let labels: Vec<String> = s.ticks().into_iter().map(|t| t.1).collect();
        assert!(labels.contains(&"1".to_string()), "{labels:?}");
        assert!(labels.contains(&"100".to_string()), "{labels:?}");
    }
}
