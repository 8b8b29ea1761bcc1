// A small traced and profiled Node.js program, run by tests/e2e/test_real_sdks.py: the
// OpenTelemetry JS SDK exports its spans over OTLP/HTTP (protobuf), and the Pyroscope
// Node.js SDK (@pyroscope/nodejs: V8's sampling profiler through @datadog/pprof, with the
// CPU time of each sample) uploads its profiles to the legacy /ingest endpoint, as any Node
// service using them would. Nothing in it knows about spanprof but the two addresses.
//
// Node has no OpenTelemetry integration that labels profiles with spans (Go has
// otel-profiling-go, Python pyroscope-otel, Java io.pyroscope:otel): the program labels each
// root span's work itself with the SDK's Pyroscope.wrapWithLabels({span_id, trace_id}, fn).
//
// Environment:
//
//   SPANPROF_OTLP_HTTP   http://127.0.0.1:4318 (spans go to $SPANPROF_OTLP_HTTP/v1/traces)
//   SPANPROF_PYROSCOPE   http://127.0.0.1:4040 (the Pyroscope server address)
//   SERVICE              service.name and the Pyroscope application name
//   ITERATIONS           how many crunch + idle pairs (default 6)
//   CRUNCH_MS, IDLE_MS   the CPU time each crunch burns, the time each idle sleeps (300, 200)
//   UPLOAD_MS            the profiler's upload interval (default 1000)
//
// Each iteration runs two root spans: "crunch", which spends CRUNCH_MS of CPU time in
// burnCpuInHashLoop, and "idle", which sleeps IDLE_MS. The CPU time the JavaScript thread
// used in each span is measured around its work (the thread's own schedstat, which is what
// the profiler's per-sample CPU time counts too). At the end the spans are flushed, then the
// profiler is stopped (its last profiles uploaded); one JSON line goes to stdout:
// {"crunch": [[trace_id, span_id], ...], "idle": [...], "crunch_cpu_ns": [...],
// "idle_cpu_ns": [...]}. Run with DEBUG=pyroscope, the SDK logs a refused upload on stderr
// ("Server rejected data ingest: HTTP 400").
'use strict';

const fs = require('node:fs');
const { setTimeout: sleep } = require('node:timers/promises');
// the SDK's whole API (init, startWallProfiling, stopWallProfiling, wrapWithLabels,
// getLabels, setLabels) is its
// default export
const Pyroscope = require('@pyroscope/nodejs').default;
const { OTLPTraceExporter } = require('@opentelemetry/exporter-trace-otlp-proto');
const { resourceFromAttributes } = require('@opentelemetry/resources');
const { BasicTracerProvider, BatchSpanProcessor } = require('@opentelemetry/sdk-trace-base');

// The CPU time, in ns, the calling thread (the JavaScript thread) has used: Linux's
// /proc/thread-self/schedstat. Where it is missing, the process's (process.cpuUsage()).
function threadCpuNs() {
  try {
    return Number(fs.readFileSync('/proc/thread-self/schedstat', 'utf8').split(' ')[0]);
  } catch {
    const u = process.cpuUsage();
    return (u.user + u.system) * 1000;
  }
}

// FNV-1a over integers until the process has used ms of CPU time (not wall time: on a busy
// machine the span is longer, its CPU the same; the program does nothing else meanwhile),
// or ten times that of wall time. The profiler's samples land in this frame (the SDK names
// a function by file, name and line: "./app.js:burnCpuInHashLoop:LINE", the hot loop being
// on one line).
function burnCpuInHashLoop(ms) {
  const cpu = () => {
    const u = process.cpuUsage();
    return (u.user + u.system) / 1000;
  };
  const start = cpu();
  const deadline = Date.now() + 10 * ms;
  let h = 0x811c9dc5;
  while (cpu() - start < ms && Date.now() < deadline) {
    for (let i = 0; i < 400000; i++) h = Math.imul(h ^ (i & 0xff), 0x01000193) >>> 0;
  }
  return h;
}

function required(name) {
  const v = process.env[name];
  if (!v) throw new Error(`${name} is required`);
  return v.replace(/\/+$/, '');
}

function envInt(name, def) {
  const v = Number.parseInt(process.env[name] ?? '', 10);
  return Number.isNaN(v) ? def : v;
}

async function main() {
  const service = required('SERVICE');
  const otlp = required('SPANPROF_OTLP_HTTP');
  const server = required('SPANPROF_PYROSCOPE');
  const iterations = envInt('ITERATIONS', 6);
  const crunchMs = envInt('CRUNCH_MS', 300);
  const idleMs = envInt('IDLE_MS', 200);

  Pyroscope.init({
    serverAddress: server,
    appName: service,
    flushIntervalMs: envInt('UPLOAD_MS', 1000),
    tags: { node_app: '1' },
    // the wall profiler with each sample's CPU time: the SDK's CPU profile
    wall: { collectCpuTime: true, samplingIntervalMicros: 10000 },
  });
  // the wall profiler only (what the CPU figures come from): start() also runs the heap
  // profiler, whose last round can fire after stop() and throw 'Heap profiler is not
  // enabled' (@pyroscope/nodejs 0.6.4), failing the run 1 time in a few
  Pyroscope.startWallProfiling();

  const provider = new BasicTracerProvider({
    resource: resourceFromAttributes({ 'service.name': service }),
    spanProcessors: [
      new BatchSpanProcessor(
        new OTLPTraceExporter({ url: `${otlp}/v1/traces`, timeoutMillis: 30000 }),
        { scheduledDelayMillis: 500 },
      ),
    ],
  });
  const tracer = provider.getTracer('spanprof-node-app');

  // the sampler starts with Pyroscope.start(): burn a little outside any span first, so
  // that the first span is sampled like the others
  let sink = burnCpuInHashLoop(200);
  await sleep(300);
  const out = { crunch: [], idle: [], crunch_cpu_ns: [], idle_cpu_ns: [] };
  for (let i = 0; i < iterations; i++) {
    for (const [name, work] of [
      ['crunch', () => { sink ^= burnCpuInHashLoop(crunchMs); }],
      ['idle', null],
    ]) {
      const span = tracer.startSpan(name);
      const { traceId, spanId } = span.spanContext();
      const labels = { span_id: spanId, trace_id: traceId };
      let cpu;
      if (work !== null) {
        Pyroscope.wrapWithLabels(labels, () => {
          const cpu0 = threadCpuNs();
          work();
          cpu = threadCpuNs() - cpu0;
        });
      } else {
        // a sleep is not synchronous work: the labels are set around it (the SDK's
        // wrapWithLabels only wraps a function that returns when the work is done)
        const before = Pyroscope.getLabels();
        Pyroscope.setLabels({ ...before, ...labels });
        const cpu0 = threadCpuNs();
        await sleep(idleMs);
        cpu = threadCpuNs() - cpu0;
        Pyroscope.setLabels(before);
      }
      span.end();
      out[name].push([traceId, spanId]);
      out[`${name}_cpu_ns`].push(cpu);
    }
  }

  await provider.shutdown(); // exports every span still queued, waits for the answer
  await Pyroscope.stopWallProfiling(); // uploads the last profile, waits for the answer
  process.stdout.write(`${JSON.stringify(out)}\n`);
  process.stderr.write(`checksum ${sink}\n`);
}

main().catch((err) => {
  process.stderr.write(`${err.stack ?? err}\n`);
  process.exit(1);
});
