package spanprof.capture;

import io.opentelemetry.api.GlobalOpenTelemetry;
import io.opentelemetry.api.trace.Span;
import io.opentelemetry.api.trace.SpanKind;
import io.opentelemetry.api.trace.Tracer;
import io.opentelemetry.context.Scope;

import java.lang.management.ManagementFactory;
import java.lang.management.ThreadMXBean;
import java.util.ArrayList;
import java.util.Collections;
import java.util.List;

/**
 * Traced requests that measure their own CPU time, run by tests/e2e/test_java_agent.py
 * under the Pyroscope Java agent, the OpenTelemetry Java agent and the Pyroscope OTel
 * extension, against a running spanprof. Nothing in it knows about spanprof: the agents
 * export the spans and upload the profiles.
 *
 * <p>Arguments: {@code REQUESTS WORKERS CRUNCH_MS PREPARE_MS LINGER_MS} (defaults 5 2 400
 * 40 5000). First {@link #crunch} and {@link #prepare} run outside any span, so that the
 * JIT has compiled them before a span measures them. Then {@code WORKERS} threads
 * ({@code worker-1}, ...) each serve {@code REQUESTS} requests: a root span "handle" that
 * spends {@code PREPARE_MS} of CPU time in {@link #prepare}, then runs a child span
 * "crunch" that spends {@code CRUNCH_MS} of CPU time in {@link #crunch} (the busy
 * method), then sleeps 30 ms. The Pyroscope OTel extension labels every sample of a
 * request with the root span (the local root): the samples taken in {@link #crunch} belong
 * to the child, running on their thread at their instant.
 *
 * <p>Each request's CPU time is read from {@link ThreadMXBean#getCurrentThreadCpuTime()}
 * around the work inside each span; the figures are printed on stdout as one JSON line,
 * {@code {"requests": [{"trace_id", "root_span_id", "span_id", "thread", "thread_id",
 * "crunch_cpu_ns", "prepare_cpu_ns", "root_cpu_ns"}, ...]}}, {@code root_cpu_ns} being all
 * the CPU time of the thread from the root span's start to its end. Then the program
 * waits {@code LINGER_MS}: the Pyroscope agent uploads what it recorded every upload
 * interval and not at exit, so the last requests' samples need one more upload.
 */
public final class MeasuredApp {
    private static final ThreadMXBean THREADS = ManagementFactory.getThreadMXBean();
    private static final List<String> REQUESTS = Collections.synchronizedList(new ArrayList<>());
    private static volatile long sink;

    private MeasuredApp() {}

    public static void main(String[] args) throws InterruptedException {
        int requests = args.length > 0 ? Integer.parseInt(args[0]) : 5;
        int workers = args.length > 1 ? Integer.parseInt(args[1]) : 2;
        long crunchMs = args.length > 2 ? Long.parseLong(args[2]) : 400;
        long prepareMs = args.length > 3 ? Long.parseLong(args[3]) : 40;
        long lingerMs = args.length > 4 ? Long.parseLong(args[4]) : 5000;
        if (!THREADS.isCurrentThreadCpuTimeSupported()) {
            throw new IllegalStateException("this JVM cannot measure a thread's CPU time");
        }
        THREADS.setThreadCpuTimeEnabled(true);
        for (int i = 0; i < 4; i++) {  // warm-up, outside any span
            crunch(100);
            prepare(20);
        }
        Tracer tracer = GlobalOpenTelemetry.getTracer("spanprof.measured");
        List<Thread> threads = new ArrayList<>();
        for (int w = 1; w <= workers; w++) {
            threads.add(new Thread(() -> {
                for (int r = 0; r < requests; r++) {
                    handle(tracer, crunchMs, prepareMs);
                }
            }, "worker-" + w));
        }
        threads.forEach(Thread::start);
        for (Thread t : threads) {
            t.join();
        }
        synchronized (REQUESTS) {
            System.out.println("{\"requests\": [" + String.join(", ", REQUESTS) + "]}");
        }
        System.out.flush();
        Thread.sleep(lingerMs);
    }

    /** One request: root span "handle", child span "crunch"; records its CPU times. */
    private static void handle(Tracer tracer, long crunchMs, long prepareMs) {
        long rootStart = cpuNow();
        long prepareCpu;
        long crunchCpu;
        Span root = tracer.spanBuilder("handle").setNoParent().setSpanKind(SpanKind.SERVER)
            .startSpan();
        Span child;
        try (Scope ignored = root.makeCurrent()) {
            long t0 = cpuNow();
            prepare(prepareMs);
            prepareCpu = cpuNow() - t0;
            child = tracer.spanBuilder("crunch").startSpan();
            try (Scope alsoIgnored = child.makeCurrent()) {
                long t1 = cpuNow();
                crunch(crunchMs);
                crunchCpu = cpuNow() - t1;
            } finally {
                child.end();
            }
            sleepMs(30);
        } finally {
            root.end();
        }
        long rootCpu = cpuNow() - rootStart;
        Thread me = Thread.currentThread();
        REQUESTS.add(String.format("{\"trace_id\": \"%s\", \"root_span_id\": \"%s\", "
            + "\"span_id\": \"%s\", \"thread\": \"%s\", \"thread_id\": %d, "
            + "\"crunch_cpu_ns\": %d, \"prepare_cpu_ns\": %d, \"root_cpu_ns\": %d}",
            root.getSpanContext().getTraceId(), root.getSpanContext().getSpanId(),
            child.getSpanContext().getSpanId(), me.getName(), me.getId(), crunchCpu,
            prepareCpu, rootCpu));
    }

    private static long cpuNow() {
        return THREADS.getCurrentThreadCpuTime();
    }

    /**
     * The busy method: FNV-1a over integers until this thread has used ms of CPU time (not
     * wall time: on a busy machine the span is longer, its CPU the same). The clock is read
     * every 200 000 rounds (a fraction of a millisecond), so that nearly all the samples
     * land in this frame and not in the clock's.
     */
    static long crunch(long ms) {
        long end = cpuNow() + ms * 1_000_000L;
        long h = 0xcbf29ce484222325L;
        while (cpuNow() < end) {
            for (int i = 0; i < 200_000; i++) {
                h = (h ^ i) * 0x100000001b3L;
            }
        }
        sink += h;
        return h;
    }

    /** The root span's own work: another loop, for ms of CPU time. */
    static long prepare(long ms) {
        long end = cpuNow() + ms * 1_000_000L;
        long h = 17;
        while (cpuNow() < end) {
            for (int i = 0; i < 200_000; i++) {
                h = h * 31 + (i ^ (h >>> 7));
            }
        }
        sink += h;
        return h;
    }

    private static void sleepMs(long ms) {
        try {
            Thread.sleep(ms);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
        }
    }
}
