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
// Each iteration runs two root spans: "crunch", which spends CRUNCH_MS of its thread's CPU
// time in burnCPUInHashLoop, and "idle", which sleeps IDLE_MS. The spans run on the main
// goroutine locked to its OS thread, and the CPU time that thread used in each span is
// measured around its work (CLOCK_THREAD_CPUTIME_ID). At the end the spans are flushed, then
// the profiler is flushed (its last profiles uploaded) and stopped; one JSON line goes to
// stdout: {"crunch": [[trace_id, span_id], ...], "idle": [...], "crunch_cpu_ns": [...],
// "idle_cpu_ns": [...]}. Upload errors are logged by the SDK on stderr ("upload profile: ...").
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unsafe"

	otelpyroscope "github.com/grafana/otel-profiling-go"
	"github.com/grafana/pyroscope-go"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.26.0"
	"go.opentelemetry.io/otel/trace"
)

// burnCPUInHashLoop runs FNV-1a over integers until this thread has used ms of CPU time
// (not wall time: on a busy machine the span is longer, its CPU the same), or ten times
// that of wall time. The profiler's samples land in this frame; noinline keeps it a frame
// of its own.
//
//go:noinline
func burnCPUInHashLoop(ms int) uint32 {
	budget := time.Duration(ms) * time.Millisecond
	start, deadline := threadCPU(), time.Now().Add(10*budget)
	h := uint32(0x811C9DC5)
	for threadCPU()-start < budget && time.Now().Before(deadline) {
		for i := 0; i < 20000; i++ {
			h = (h ^ uint32(i&0xFF)) * 0x01000193
		}
	}
	return h
}

// threadCPU is the CPU time the calling OS thread has used: the caller is locked to its
// thread (runtime.LockOSThread), so it is the goroutine's. The Go runtime's CPU profiler
// samples each thread by a timer on that same clock.
func threadCPU() time.Duration {
	const clockThreadCPUTimeID = 3 // CLOCK_THREAD_CPUTIME_ID
	var ts syscall.Timespec
	_, _, errno := syscall.Syscall(syscall.SYS_CLOCK_GETTIME, clockThreadCPUTimeID,
		uintptr(unsafe.Pointer(&ts)), 0)
	if errno != 0 {
		return 0
	}
	return time.Duration(ts.Nano())
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

func spanIDs(span trace.Span) []string {
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

	// pyroscope.Start starts the CPU profiler in a goroutine of its own: let it run and
	// burn a little outside any span before the first one, so that the first span is
	// sampled like the others (the runtime arms a thread's profiling timer when it sees
	// the profiler on)
	time.Sleep(300 * time.Millisecond)
	sink := burnCPUInHashLoop(200)
	ids := map[string][][]string{"crunch": {}, "idle": {}, "nested": {}}
	cpu := map[string][]int64{"crunch": {}, "idle": {}, "nested": {}, "nested_child": {}}
	for i := 0; i < iterations; i++ {
		_, span := tracer.Start(ctx, "crunch")
		cpu0 := threadCPU()
		sink ^= burnCPUInHashLoop(crunchMS)
		cpu["crunch"] = append(cpu["crunch"], int64(threadCPU()-cpu0))
		span.End()
		ids["crunch"] = append(ids["crunch"], spanIDs(span))

		_, span = tracer.Start(ctx, "idle")
		cpu0 = threadCPU()
		time.Sleep(time.Duration(idleMS) * time.Millisecond)
		cpu["idle"] = append(cpu["idle"], int64(threadCPU()-cpu0))
		span.End()
		ids["idle"] = append(ids["idle"], spanIDs(span))

		// a root span with a child: otel-profiling-go labels both parts' samples with the
		// root; the child's share reaches it only through spanprof's link+share
		rctx, root := tracer.Start(ctx, "handle")
		cpu0 = threadCPU()
		sink ^= burnCPUInHashLoop(crunchMS / 3)
		_, child := tracer.Start(rctx, "hash")
		cpu1 := threadCPU()
		sink ^= burnCPUInHashLoop(crunchMS)
		childCPU := int64(threadCPU() - cpu1)
		child.End()
		root.End()
		cpu["nested_child"] = append(cpu["nested_child"], childCPU)
		cpu["nested"] = append(cpu["nested"], int64(threadCPU()-cpu0))
		ids["nested"] = append(ids["nested"], append(spanIDs(root), child.SpanContext().SpanID().String()))
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
	doc, _ := json.Marshal(map[string]interface{}{
		"crunch": ids["crunch"], "idle": ids["idle"],
		"crunch_cpu_ns": cpu["crunch"], "idle_cpu_ns": cpu["idle"],
		"nested": ids["nested"], "nested_cpu_ns": cpu["nested"],
		"nested_child_cpu_ns": cpu["nested_child"],
	})
	fmt.Println(string(doc))
	fmt.Fprintf(os.Stderr, "checksum %d\n", sink)
	return nil
}

func main() {
	// the spans run on the main goroutine: on one OS thread, whose CPU clock measures them
	runtime.LockOSThread()
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
