// A small traced and profiled Go program, run by tests/e2e/test_go_sdk.py: the
// OpenTelemetry Go SDK exports its spans over OTLP/HTTP, and the Pyroscope Go SDK
// (pyroscope-go, with otel-profiling-go labelling samples with the local root span)
// uploads its profiles to the legacy /ingest endpoint, as any Go service using them would.
// Nothing in it knows about spanprof but the two addresses.
//
// Environment:
//
//	SPANPROF_OTLP_HTTP   http://127.0.0.1:4318 (spans go to $SPANPROF_OTLP_HTTP/v1/traces)
//	SPANPROF_PYROSCOPE   http://127.0.0.1:4040 (the Pyroscope server address)
//	SERVICE              service.name and the Pyroscope application name
//	ITERATIONS           how many crunch + idle pairs (default 6)
//	CRUNCH_MS, IDLE_MS   the CPU time each crunch burns, the time each idle sleeps (300, 200)
//	UPLOAD_MS            the profiler's upload interval (default 1000)
//
// Each iteration runs two root spans: "crunch", which spends CRUNCH_MS of CPU time in
// burnCPUInHashLoop, and "idle", which sleeps IDLE_MS. At the end the spans are flushed,
// then the profiler is flushed (its last profiles uploaded) and stopped; the span ids are printed
// on stdout as one JSON line: {"crunch": [[trace_id, span_id], ...], "idle": [...]}.
// Upload errors are logged by the SDK on stderr ("upload profile: ...").
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	otelpyroscope "github.com/grafana/otel-profiling-go"
	"github.com/grafana/pyroscope-go"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.26.0"
	"go.opentelemetry.io/otel/trace"
)

// burnCPUInHashLoop runs FNV-1a over integers until the process has used ms of CPU
// time (not wall time: on a busy machine the span is longer, its CPU the same), or ten
// times that of wall time. The profiler's samples land in this frame; noinline keeps it
// a frame of its own.
//
//go:noinline
func burnCPUInHashLoop(ms int) uint32 {
	budget := time.Duration(ms) * time.Millisecond
	start, deadline := cpuTime(), time.Now().Add(10*budget)
	h := uint32(0x811C9DC5)
	for cpuTime()-start < budget && time.Now().Before(deadline) {
		for i := 0; i < 20000; i++ {
			h = (h ^ uint32(i&0xFF)) * 0x01000193
		}
	}
	return h
}

// cpuTime is the CPU time the process has used (user + system).
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// stderrLogger is the SDK's logger: its errors (failed uploads) reach the test's output.
type stderrLogger struct{}

func (stderrLogger) Infof(f string, a ...interface{})  {}
func (stderrLogger) Debugf(f string, a ...interface{}) {}
func (stderrLogger) Errorf(f string, a ...interface{}) {
	fmt.Fprintf(os.Stderr, "pyroscope error: "+f+"\n", a...)
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil {
		return v
	}
	return def
}

func ids(span trace.Span) []string {
	sc := span.SpanContext()
	return []string{sc.TraceID().String(), sc.SpanID().String()}
}

func run() error {
	service := os.Getenv("SERVICE")
	otlp := strings.TrimRight(os.Getenv("SPANPROF_OTLP_HTTP"), "/")
	server := os.Getenv("SPANPROF_PYROSCOPE")
	if service == "" || otlp == "" || server == "" {
		return fmt.Errorf("SERVICE, SPANPROF_OTLP_HTTP and SPANPROF_PYROSCOPE are required")
	}
	iterations := envInt("ITERATIONS", 6)
	crunchMS, idleMS := envInt("CRUNCH_MS", 300), envInt("IDLE_MS", 200)

	profiler, err := pyroscope.Start(pyroscope.Config{
		ApplicationName: service,
		ServerAddress:   server,
		UploadRate:      time.Duration(envInt("UPLOAD_MS", 1000)) * time.Millisecond,
		Logger:          stderrLogger{},
		Tags:            map[string]string{"go_app": "1"},
		// the defaults (CPU and the four heap types) and the godeltaprof ones, so that
		// every kind of upload this SDK makes is sent
		ProfileTypes: append(append([]pyroscope.ProfileType{}, pyroscope.DefaultProfileTypes...),
			pyroscope.ProfileGoroutines, pyroscope.ProfileMutexCount,
			pyroscope.ProfileMutexDuration, pyroscope.ProfileBlockCount,
			pyroscope.ProfileBlockDuration),
	})
	if err != nil {
		return fmt.Errorf("pyroscope.Start: %w", err)
	}

	ctx := context.Background()
	exporter, err := otlptracehttp.New(ctx, otlptracehttp.WithEndpointURL(otlp+"/v1/traces"),
		otlptracehttp.WithTimeout(30*time.Second))
	if err != nil {
		return fmt.Errorf("otlptracehttp: %w", err)
	}
	res := resource.NewWithAttributes(semconv.SchemaURL, semconv.ServiceName(service))
	sdk := sdktrace.NewTracerProvider(sdktrace.WithResource(res),
		sdktrace.WithBatcher(exporter, sdktrace.WithBatchTimeout(500*time.Millisecond)))
	tracer := otelpyroscope.NewTracerProvider(sdk).Tracer("spanprof-go-app")

	// pyroscope.Start starts the CPU profiler in a goroutine of its own: let it run
	// before the first span, or that span's first samples are not taken
	time.Sleep(300 * time.Millisecond)
	out := map[string][][]string{"crunch": {}, "idle": {}}
	var sink uint32
	for i := 0; i < iterations; i++ {
		_, span := tracer.Start(ctx, "crunch")
		sink ^= burnCPUInHashLoop(crunchMS)
		span.End()
		out["crunch"] = append(out["crunch"], ids(span))

		_, span = tracer.Start(ctx, "idle")
		time.Sleep(time.Duration(idleMS) * time.Millisecond)
		span.End()
		out["idle"] = append(out["idle"], ids(span))
	}

	if err := sdk.Shutdown(ctx); err != nil { // exports every span still queued
		return fmt.Errorf("tracer provider shutdown: %w", err)
	}
	// Flush(true) uploads the profiles of the interval so far and waits for the answers;
	// Stop alone may drop what is still queued
	profiler.Flush(true)
	if err := profiler.Stop(); err != nil {
		return fmt.Errorf("profiler.Stop: %w", err)
	}
	doc, _ := json.Marshal(out)
	fmt.Println(string(doc))
	fmt.Fprintf(os.Stderr, "checksum %d\n", sink)
	return nil
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
