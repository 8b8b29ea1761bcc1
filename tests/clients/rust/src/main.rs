//! A small traced and profiled Rust program, run by tests/e2e/test_rust_sdk.py: the
//! OpenTelemetry Rust SDK exports its spans over OTLP/HTTP (protobuf), and the Pyroscope
//! Rust SDK (`pyroscope` with its pprof-rs backend) pushes its CPU profile to
//! `/push.v1.PusherService/Push`, as any Rust service using them would. Nothing in it knows
//! about spanprof but the two addresses.
//!
//! Rust has no OpenTelemetry integration that labels profiles with spans (Go has
//! otel-profiling-go, Python pyroscope-otel, Java io.pyroscope:otel): the program labels
//! its root spans itself with the SDK's thread tags (`tag_wrapper`), `span_id` set on the
//! thread for the span's duration.
//!
//! Environment:
//!
//!   SPANPROF_OTLP_HTTP   http://127.0.0.1:4318 (spans go to $SPANPROF_OTLP_HTTP/v1/traces)
//!   SPANPROF_PYROSCOPE   http://127.0.0.1:4040 (the Pyroscope server address)
//!   SERVICE              service.name and the Pyroscope application name
//!   ITERATIONS           how many crunch + idle pairs (default 6)
//!   CRUNCH_MS, IDLE_MS   the CPU time each crunch burns, the time each idle sleeps (300, 200)
//!   UPLOAD_MS            the profiler's upload interval (default 1000)
//!
//! Each iteration runs two root spans: "crunch", which spends CRUNCH_MS of its thread's CPU
//! time in `burn_cpu_in_hash_loop`, and "idle", which sleeps IDLE_MS. The CPU time the
//! thread used in each span is measured around its work (CLOCK_THREAD_CPUTIME_ID). At the
//! end the spans are flushed, an upload interval waited, then the profiler stopped (its
//! last profile pushed); one JSON line goes to stdout: {"crunch": [[trace_id, span_id],
//! ...], "idle": [...], "crunch_cpu_ns": [...], "idle_cpu_ns": [...]}.

use std::env;
use std::hint::black_box;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use opentelemetry::trace::{Span, Tracer, TracerProvider as _};
use opentelemetry_otlp::{SpanExporter, WithExportConfig};
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use pyroscope::backend::{pprof_backend, BackendConfig, PprofConfig};
use pyroscope::pyroscope::PyroscopeAgentBuilder;

type Error = Box<dyn std::error::Error>;

/// The CPU time this thread has used.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: ts is a valid timespec for the call to fill
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// FNV-1a over integers until this thread has used `budget` of CPU time (not wall time: on
/// a busy machine the span is longer, its CPU the same), or ten times that of wall time.
/// The profiler's samples land in this frame; inline(never) keeps it a frame of its own.
#[inline(never)]
fn burn_cpu_in_hash_loop(budget: Duration) -> u32 {
    let (start, deadline) = (thread_cpu(), Instant::now() + 10 * budget);
    let mut h: u32 = 0x811C_9DC5;
    while thread_cpu() - start < budget && Instant::now() < deadline {
        for i in 0..20_000u32 {
            h = black_box((h ^ (i & 0xFF)).wrapping_mul(0x0100_0193));
        }
    }
    h
}

fn env_u64(name: &str, default: u64) -> u64 {
    env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn required(name: &str) -> Result<String, Error> {
    match env::var(name) {
        Ok(v) if !v.is_empty() => Ok(v.trim_end_matches('/').to_string()),
        _ => Err(format!("{name} is required").into()),
    }
}

fn json_ids(ids: &[(String, String)]) -> String {
    let items: Vec<String> = ids.iter().map(|(t, s)| format!("[\"{t}\",\"{s}\"]")).collect();
    format!("[{}]", items.join(","))
}

fn json_nums(ns: &[u128]) -> String {
    let items: Vec<String> = ns.iter().map(|n| n.to_string()).collect();
    format!("[{}]", items.join(","))
}

fn run() -> Result<(), Error> {
    let service = required("SERVICE")?;
    let otlp = required("SPANPROF_OTLP_HTTP")?;
    let server = required("SPANPROF_PYROSCOPE")?;
    let iterations = env_u64("ITERATIONS", 6);
    let crunch = Duration::from_millis(env_u64("CRUNCH_MS", 300));
    let idle = Duration::from_millis(env_u64("IDLE_MS", 200));
    let upload = Duration::from_millis(env_u64("UPLOAD_MS", 1000));

    let backend = pprof_backend(
        PprofConfig { sample_rate: 100 },
        BackendConfig { report_thread_id: true, report_thread_name: false, report_pid: false },
    );
    let agent = PyroscopeAgentBuilder::new(&server, &service, 100, "pyroscope-rs", "2.1.5", backend)
        .tags(vec![("rust_app", "1")])
        .upload_interval(upload)
        .build()?
        .start()?;
    let (add_tag, remove_tag) = agent.tag_wrapper();

    let exporter = SpanExporter::builder()
        .with_http()
        .with_endpoint(format!("{otlp}/v1/traces"))
        .with_timeout(Duration::from_secs(30))
        .build()?;
    let provider = SdkTracerProvider::builder()
        .with_resource(Resource::builder().with_service_name(service.clone()).build())
        .with_batch_exporter(exporter)
        .build();
    let tracer = provider.tracer("spanprof-rust-app");

    // the profiler's timer is armed by start(): burn a little outside any span first, so
    // that the first span is sampled like the others
    let mut sink = burn_cpu_in_hash_loop(Duration::from_millis(200));
    let (mut crunch_ids, mut idle_ids) = (Vec::new(), Vec::new());
    let (mut crunch_cpu, mut idle_cpu) = (Vec::new(), Vec::new());
    for _ in 0..iterations {
        let mut span = tracer.start("crunch");
        let sc = span.span_context().clone();
        let span_id = sc.span_id().to_string();
        add_tag("span_id".to_string(), span_id.clone())?;
        let cpu0 = thread_cpu();
        sink ^= burn_cpu_in_hash_loop(crunch);
        crunch_cpu.push((thread_cpu() - cpu0).as_nanos());
        remove_tag("span_id".to_string(), span_id.clone())?;
        span.end();
        crunch_ids.push((sc.trace_id().to_string(), span_id));

        let mut span = tracer.start("idle");
        let sc = span.span_context().clone();
        let span_id = sc.span_id().to_string();
        add_tag("span_id".to_string(), span_id.clone())?;
        let cpu0 = thread_cpu();
        std::thread::sleep(idle);
        idle_cpu.push((thread_cpu() - cpu0).as_nanos());
        remove_tag("span_id".to_string(), span_id.clone())?;
        span.end();
        idle_ids.push((sc.trace_id().to_string(), span_id));
    }

    provider.shutdown()?; // exports every span still queued, waits for the answer
    // one upload interval and a margin before stopping, so that the last span's samples
    // go in a regular upload: the SDK's stop() has been seen to push only 2 of the last
    // crunch's 30 (20 of 300 ms, 2026-12-07; every earlier span whole)
    std::thread::sleep(upload + Duration::from_millis(500));
    let agent = agent.stop()?; // pushes the last profile, waits for the upload thread
    agent.shutdown();
    println!(
        "{{\"crunch\": {}, \"idle\": {}, \"crunch_cpu_ns\": {}, \"idle_cpu_ns\": {}}}",
        json_ids(&crunch_ids),
        json_ids(&idle_ids),
        json_nums(&crunch_cpu),
        json_nums(&idle_cpu)
    );
    eprintln!("checksum {sink}");
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("{err}");
            ExitCode::FAILURE
        }
    }
}
