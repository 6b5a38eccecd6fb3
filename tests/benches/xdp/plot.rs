//! The benchmark's figures, drawn as SVG with plotters from the measured
//! series (nothing is drawn by hand).

use std::path::Path;

use anyhow::{Result, anyhow};
use plotters::{prelude::*, style::FontStyle};

const COLORS: [RGBColor; 5] = [
    RGBColor(0x44, 0x44, 0x44),
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xff, 0x7f, 0x0e),
];

/// The font every figure's text is measured and drawn with (Debian's
/// fonts-dejavu-core): plotters' pure-Rust text (`ab_glyph`) knows only
/// the fonts registered.
const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

/// Registers [`FONT`] as `sans-serif`; before any figure is drawn.
pub fn register_font() -> Result<()> {
    let font = std::fs::read(FONT)
        .map_err(|e| anyhow!("{FONT} (Debian's fonts-dejavu-core; `cargo xtask setup`): {e}"))?;
    let font: &'static [u8] = Box::leak(font.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, font)
        .map_err(|_| anyhow!("{FONT} is not a font"))
}

/// One named series of (x, y) points.
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

pub struct Figure<'a> {
    pub title: &'a str,
    pub x_label: &'a str,
    pub y_label: &'a str,
    /// Logarithmic x axis (keys, rates).
    pub log_x: bool,
}

pub fn lines(path: &Path, figure: &Figure, series: &[Series]) -> Result<()> {
    let err = |e: &dyn std::fmt::Display| anyhow!("drawing {}: {e}", path.display());
    let root = SVGBackend::new(path, (760, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let all = series.iter().flat_map(|s| s.points.iter().copied());
    let (x_max, y_max) = all
        .clone()
        .fold((0f64, 0f64), |(x, y), (px, py)| (x.max(px), y.max(py)));
    let x_min = all.map(|(x, _)| x).fold(f64::MAX, f64::min);
    let y_range = 0.0..(y_max * 1.15).max(1e-9);
    let mut builder = ChartBuilder::on(&root);
    builder
        .caption(figure.title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60);
    macro_rules! draw {
        ($chart:expr) => {{
            let mut chart = $chart;
            chart
                .configure_mesh()
                .x_desc(figure.x_label)
                .y_desc(figure.y_label)
                .draw()
                .map_err(|e| err(&e))?;
            for (i, s) in series.iter().enumerate() {
                let color = COLORS[i % COLORS.len()];
                chart
                    .draw_series(LineSeries::new(
                        s.points.iter().copied(),
                        color.stroke_width(2),
                    ))
                    .map_err(|e| err(&e))?
                    .label(s.name.as_str())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                    });
                chart
                    .draw_series(s.points.iter().map(|&p| Circle::new(p, 3, color.filled())))
                    .map_err(|e| err(&e))?;
            }
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .position(SeriesLabelPosition::UpperRight)
                .draw()
                .map_err(|e| err(&e))?;
        }};
    }
    if figure.log_x {
        draw!(
            builder
                .build_cartesian_2d((x_min.max(1e-9)..x_max * 1.5).log_scale(), y_range)
                .map_err(|e| err(&e))?
        );
    } else {
        draw!(
            builder
                .build_cartesian_2d(0.0..x_max * 1.02, y_range)
                .map_err(|e| err(&e))?
        );
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
