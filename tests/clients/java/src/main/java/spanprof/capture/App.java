package spanprof.capture;

import io.opentelemetry.api.GlobalOpenTelemetry;
import io.opentelemetry.api.trace.Span;
import io.opentelemetry.api.trace.SpanKind;
import io.opentelemetry.api.trace.Tracer;
import io.opentelemetry.context.Scope;
import io.pyroscope.javaagent.api.ProfilerApi;
import io.pyroscope.javaagent.api.ProfilerApiHolder;
import io.pyroscope.labels.v2.LabelsSet;
import io.pyroscope.labels.v2.ScopedContext;

import java.time.Instant;
import java.util.ArrayList;
import java.util.Collections;
import java.util.List;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.locks.ReentrantLock;

/**
 * A small traced and profiled program, run by tests/clients/java/capture.py under the
 * Pyroscope Java agent, the OpenTelemetry Java agent and the Pyroscope OTel extension.
 * Nothing in it knows about spanprof: the agents make the spans and upload the profiles.
 *
 * <p>For {@code args[0]} seconds (default 8) these threads run:
 * <ul>
 *   <li>{@code cpu-worker}: root spans "checkout", each spending ~150 ms in {@link #spin} (the
 *       hot method), ~50 ms more in a child span "price"; then ~40 ms of {@link #spin} outside
 *       any span, and ~20 ms under a Pyroscope label context {@code order_type=express};</li>
 *   <li>{@code allocator}: root spans "batch", 10 times allocating ~2 MiB in {@link #churn}
 *       then sleeping 20 ms;</li>
 *   <li>{@code lock-a}, {@code lock-b}: root spans "contend", each fighting 50 times over a
 *       monitor and a {@link ReentrantLock} held ~3 ms ({@link #holdMonitor}, {@link #holdLock});</li>
 *   <li>{@code sleeper}: root spans "sleepy" that sleep 500 ms (off-CPU: wall samples only).</li>
 * </ul>
 *
 * <p>Inside each root span the program also passes the span's trace id to the profiler
 * ({@code ProfilerApi.setTraceId}), as the Pyroscope OTel extension does from 2.x on, so
 * that the recording's trace id fields are filled too. At the end it prints each root span
 * as one JSON line on stdout: {@code {"name", "trace_id", "span_id", "thread", "start", "end"}}
 * (times in Unix ns).
 */
public final class App {
    private static final Object MONITOR = new Object();
    private static final ReentrantLock LOCK = new ReentrantLock();
    private static final List<String> SPANS = Collections.synchronizedList(new ArrayList<>());
    private static volatile long sink;

    private App() {}

    public static void main(String[] args) throws InterruptedException {
        long seconds = args.length > 0 ? Long.parseLong(args[0]) : 8;
        long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(seconds);
        Tracer tracer = GlobalOpenTelemetry.getTracer("spanprof.capture");
        List<Thread> threads = List.of(
            new Thread(() -> cpuWorker(tracer, deadline), "cpu-worker"),
            new Thread(() -> allocator(tracer, deadline), "allocator"),
            new Thread(() -> contender(tracer, deadline), "lock-a"),
            new Thread(() -> contender(tracer, deadline), "lock-b"),
            new Thread(() -> sleeper(tracer, deadline), "sleeper"));
        threads.forEach(Thread::start);
        for (Thread t : threads) {
            t.join();
        }
        synchronized (SPANS) {
            SPANS.forEach(System.out::println);
        }
    }

    /** Runs body in a new root span of this name, with the trace id passed to the profiler. */
    private static void inRootSpan(Tracer tracer, String name, Runnable body) {
        long start = epochNanos();
        Span span = tracer.spanBuilder(name).setNoParent().setSpanKind(SpanKind.SERVER).startSpan();
        ProfilerApi profiler = ProfilerApiHolder.INSTANCE.get();
        try (Scope ignored = span.makeCurrent()) {
            if (profiler != null) {
                profiler.setTraceId(span.getSpanContext().getTraceId());
            }
            body.run();
        } finally {
            if (profiler != null) {
                profiler.clearTraceId();
            }
            span.end();
            SPANS.add(String.format("{\"name\": \"%s\", \"trace_id\": \"%s\", \"span_id\": \"%s\", "
                + "\"thread\": \"%s\", \"start\": %d, \"end\": %d}", name,
                span.getSpanContext().getTraceId(), span.getSpanContext().getSpanId(),
                Thread.currentThread().getName(), start, epochNanos()));
        }
    }

    private static long epochNanos() {
        Instant now = Instant.now();
        return now.getEpochSecond() * 1_000_000_000L + now.getNano();
    }

    private static void cpuWorker(Tracer tracer, long deadline) {
        while (System.nanoTime() < deadline) {
            inRootSpan(tracer, "checkout", () -> {
                spin(150);
                Span child = tracer.spanBuilder("price").startSpan();
                try (Scope ignored = child.makeCurrent()) {
                    spin(50);
                } finally {
                    child.end();
                }
            });
            spin(40);
            try (ScopedContext ignored = new ScopedContext(new LabelsSet("order_type", "express"))) {
                spin(20);
            }
        }
    }

    private static void allocator(Tracer tracer, long deadline) {
        while (System.nanoTime() < deadline) {
            inRootSpan(tracer, "batch", () -> {
                for (int i = 0; i < 10; i++) {
                    churn();
                    sleepMs(20);
                }
            });
        }
    }

    private static void contender(Tracer tracer, long deadline) {
        while (System.nanoTime() < deadline) {
            inRootSpan(tracer, "contend", () -> {
                for (int i = 0; i < 50; i++) {
                    holdMonitor(3);
                    holdLock(3);
                }
            });
        }
    }

    private static void sleeper(Tracer tracer, long deadline) {
        while (System.nanoTime() < deadline) {
            inRootSpan(tracer, "sleepy", () -> sleepMs(500));
        }
    }

    /** The hot method: integer hashing for ms of wall time. */
    static long spin(long ms) {
        long end = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(ms);
        long h = 0xcbf29ce484222325L;
        while (System.nanoTime() < end) {
            for (int i = 0; i < 10_000; i++) {
                h = (h ^ i) * 0x100000001b3L;
            }
        }
        sink += h;
        return h;
    }

    /** Allocates ~1 MiB in 400 small arrays, then one 1 MiB array. */
    static void churn() {
        List<Object> keep = new ArrayList<>();
        for (int n = 0; n < 400; n++) {
            keep.add(new long[64 + (n % 512)]);
        }
        keep.add(new byte[1 << 20]);
        sink += keep.size();
    }

    static void holdMonitor(long ms) {
        synchronized (MONITOR) {
            sleepMs(ms);
        }
    }

    static void holdLock(long ms) {
        LOCK.lock();
        try {
            sleepMs(ms);
        } finally {
            LOCK.unlock();
        }
    }

    private static void sleepMs(long ms) {
        try {
            Thread.sleep(ms);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
        }
    }
}
