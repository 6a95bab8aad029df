//! `stepgraph plan --html` in a real headless browser: the page the CLI
//! writes is loaded by Chromium, its DOM after the scripts ran is checked
//! (chart, peak marker with the planned bytes, every category, the table of
//! allocations) and a screenshot is taken and checked to be a real picture.
//!
//! Chromium comes from Debian's `chromium` package (`.ci/run` installs it
//! and sets `STEPGRAPH_REQUIRE_CHROMIUM=1`, so CI cannot skip this test);
//! elsewhere, without a browser, the test says so and passes.

use std::path::{Path, PathBuf};
use std::process::Command;

fn chromium() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("STEPGRAPH_CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .flat_map(|name| std::env::split_paths(&path).map(move |dir| dir.join(name)))
        .find(|p| p.is_file())
}

fn browser_or_skip() -> Option<PathBuf> {
    match chromium() {
        Some(p) => Some(p),
        None if std::env::var("STEPGRAPH_REQUIRE_CHROMIUM").as_deref() == Ok("1") => {
            panic!("STEPGRAPH_REQUIRE_CHROMIUM=1 but no chromium on PATH (install Debian's `chromium`)")
        }
        None => {
            eprintln!("skipped: no chromium on PATH");
            None
        }
    }
}

fn temp_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("stepgraph-html-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs headless Chromium on `page` with `extra` arguments; its stdout.
fn headless(browser: &Path, page: &Path, extra: &[&str]) -> String {
    let profile = page.with_extension("profile");
    let out = Command::new(browser)
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run"])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(extra)
        .arg(format!("file://{}", page.display()))
        .output()
        .expect("chromium starts");
    assert!(out.status.success(), "chromium failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Width and height from a PNG's IHDR chunk.
fn png_size(bytes: &[u8]) -> (u32, u32) {
    assert!(bytes.len() > 24 && bytes[..8] == *b"\x89PNG\r\n\x1a\n" && &bytes[12..16] == b"IHDR", "not a PNG");
    let w = u32::from_be_bytes(bytes[16..20].try_into().unwrap());
    let h = u32::from_be_bytes(bytes[20..24].try_into().unwrap());
    (w, h)
}

#[test]
fn the_memory_timeline_renders_in_a_browser_with_its_peak_categories_and_table() {
    let Some(browser) = browser_or_skip() else { return };
    let dir = temp_dir("render");
    let page = dir.join("timeline.html");
    let out = Command::new(env!("CARGO_BIN_EXE_stepgraph"))
        .args(["plan", "--model", "tiny-llama", "--dtype", "f32", "--batch", "2", "--seq", "32", "--loss", "ce"])
        .args(["--step", "train", "--json", "--html"])
        .arg(&page)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let planned = report["planned_peak_bytes"].as_u64().unwrap();
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(!html.contains("http://") && !html.contains("https://"), "the page must not reach the network");

    // The DOM after the page's script ran (it fills the table).
    let dom = headless(&browser, &page, &["--virtual-time-budget=5000", "--dump-dom"]);
    assert!(dom.contains(r#"id="chart""#), "no chart in the DOM");
    assert!(dom.contains(r#"id="peak""#) && dom.contains(r#"id="planned-peak""#), "no peak markers");
    assert!(dom.contains(&format!("({planned} B)")), "the planned peak {planned} B is not on the page");
    for category in
        ["parameters", "optimizer state", "gradients", "saved activations", "recomputed values", "temporaries"]
    {
        assert!(dom.contains(&format!(r#"data-category="{category}""#)), "category {category} missing");
    }
    let body = dom.split("<tbody>").nth(1).and_then(|t| t.split("</tbody>").next()).expect("the table body");
    let rows = body.matches("<tr>").count();
    assert!(rows >= 20, "the script filled {rows} table rows");
    assert!(body.contains("embed_tokens"), "the embedding is listed");

    // The screenshot is a picture of the page, not an empty canvas.
    let shot = dir.join("timeline.png");
    headless(&browser, &page, &["--window-size=1440,900", &format!("--screenshot={}", shot.display())]);
    let png = std::fs::read(&shot).unwrap();
    assert_eq!(png_size(&png), (1440, 900));
    assert!(png.len() > 30_000, "a {}-byte screenshot is too plain to hold the chart", png.len());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A plan that keeps the frozen embedding in host memory (adapters under
/// a budget one byte below the plain plan) shows it as its own band below
/// the device chart, and lists it in the table as living there.
#[test]
fn host_tables_render_as_their_own_band() {
    let Some(browser) = browser_or_skip() else { return };
    let dir = temp_dir("host");
    let plan = |extra: &[&str], page: Option<&Path>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_stepgraph"));
        cmd.args(["plan", "--model", "tiny-llama", "--dtype", "f32", "--batch", "2", "--seq", "32"])
            .args(["--lora-rank", "2", "--step", "train", "--json"])
            .args(extra);
        if let Some(page) = page {
            cmd.arg("--html").arg(page);
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let plain = plan(&[], None)["planned_peak_bytes"].as_u64().unwrap();
    let page = dir.join("host.html");
    let budget = (plain - 1).to_string();
    let report = plan(&["--memory-budget", &budget], Some(&page));
    let host = report["host_bytes"].as_u64().unwrap();
    assert!(host > 0, "the budget keeps the embedding on the host: {report}");

    let dom = headless(&browser, &page, &["--virtual-time-budget=5000", "--dump-dom"]);
    assert!(dom.contains(r#"id="host-band""#), "no host band");
    assert!(dom.contains("host memory (page-locked)"), "the band is not labelled");
    let body = dom.split("<tbody>").nth(1).and_then(|t| t.split("</tbody>").next()).expect("the table body");
    assert!(body.contains("in host memory"), "the table does not say where the embedding lives");

    let shot = dir.join("host.png");
    headless(&browser, &page, &["--window-size=1440,900", &format!("--screenshot={}", shot.display())]);
    let png = std::fs::read(&shot).unwrap();
    assert_eq!(png_size(&png), (1440, 900));
    assert!(png.len() > 30_000, "a {}-byte screenshot is too plain to hold the chart", png.len());
    if let Ok(keep) = std::env::var("STEPGRAPH_KEEP_SCREENSHOT") {
        std::fs::copy(&shot, keep).unwrap();
    }
    let _ = std::fs::remove_dir_all(&dir);
}
