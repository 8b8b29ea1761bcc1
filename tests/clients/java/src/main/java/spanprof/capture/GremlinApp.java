package spanprof.capture;

import io.opentelemetry.api.GlobalOpenTelemetry;
import io.opentelemetry.api.trace.Span;
import io.opentelemetry.api.trace.SpanKind;
import io.opentelemetry.api.trace.Tracer;
import io.opentelemetry.context.Scope;

import java.lang.management.ManagementFactory;
import java.lang.management.ThreadMXBean;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.Random;
import java.util.concurrent.BlockingQueue;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.LinkedBlockingQueue;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.concurrent.locks.ReentrantLock;

/**
 * A traced and profiled shop with a gremlin in about 2% of its calls, run by
 * tests/e2e/test_java_lock_gremlin.py under the Pyroscope Java agent (lock profiling on),
 * the OpenTelemetry Java agent and the Pyroscope OTel extension, against a running
 * spanprof (issue #21). Nothing in it knows about spanprof: the agents export the spans and
 * upload the profiles.
 *
 * <p>Arguments: {@code MODE CALLS WORKERS SLOW TYPICAL_MS HOLD_MS PAUSE_MS SEED LINGER_MS}
 * (defaults monitor 400 2 8 30 300 20 21 5000). {@code WORKERS} threads ({@code worker-1},
 * ...) serve {@code CALLS} calls between them, each a root span "place_order" that spends
 * {@code TYPICAL_MS} +- 10 ms of its thread's CPU time in {@link #priceItems}, allocates a
 * receipt in {@link #buildReceipt}, then reserves stock under its warehouse's lock; a worker
 * sleeps {@code PAUSE_MS} between calls (outside any span: the program leaves some of the
 * machine to others). Each call carries the attributes {@code warehouse}, {@code order.id}
 * (unique) and {@code cart.size} (1-5, for every call).
 *
 * <p>{@code SLOW} calls (a seeded choice: one in each of {@code SLOW} equal blocks of
 * calls, never at a block's edges, so two are never served at once) are for the
 * {@code central} warehouse, whose stock lock a holder thread ({@code stock-refresher})
 * takes for {@code HOLD_MS} in {@link #refreshCentralStock} (a remote fetch: it sleeps
 * holding the lock) just before the call reserves: the call waits for it, burning no more
 * CPU than the others. The other calls are for {@code north}, {@code south} or {@code east},
 * whose locks nobody holds for long. {@code MODE} is which lock: {@code monitor} a
 * {@code synchronized} block in {@link #reserveStock} (the JVM's monitor enter: JFR
 * {@code jdk.JavaMonitorEnter}), {@code park} a {@link ReentrantLock} taken in
 * {@link #reserveStockParked} (the thread parks: JFR {@code jdk.ThreadPark}).
 *
 * <p>At the end one JSON line goes to stdout: {@code {"mode", "calls": [{"trace_id",
 * "span_id", "slow", "thread", "thread_id", "duration_ns", "cpu_ns"}, ...]}} in call
 * order, durations and thread CPU times as the program measured them around the span's work.
 * Then the program waits {@code LINGER_MS}: the Pyroscope agent uploads every upload
 * interval and not at exit, so the last calls' samples need one more upload.
 */
public final class GremlinApp {
    private static final ThreadMXBean THREADS = ManagementFactory.getThreadMXBean();
    private static final String[] TYPICAL_WAREHOUSES = {"north", "south", "east"};
    private static volatile long sink;

    /** A warehouse's stock, behind its own lock (both kinds: MODE picks the one used). */
    static final class Warehouse {
        final String name;
        final ReentrantLock lock = new ReentrantLock();
        long stock = 1_000_000;

        Warehouse(String name) {
            this.name = name;
        }
    }

    /** One call, decided before any runs (the generator is not shared between threads). */
    record Call(boolean slow, String warehouse, String orderId, int cartSize, long typicalMs) {}

    private GremlinApp() {}

    public static void main(String[] args) throws InterruptedException {
        String mode = args.length > 0 ? args[0] : "monitor";
        int calls = args.length > 1 ? Integer.parseInt(args[1]) : 400;
        int workers = args.length > 2 ? Integer.parseInt(args[2]) : 2;
        int slowCount = args.length > 3 ? Integer.parseInt(args[3]) : 8;
        long typicalMs = args.length > 4 ? Long.parseLong(args[4]) : 30;
        long holdMs = args.length > 5 ? Long.parseLong(args[5]) : 300;
        long pauseMs = args.length > 6 ? Long.parseLong(args[6]) : 20;
        long seed = args.length > 7 ? Long.parseLong(args[7]) : 21;
        long lingerMs = args.length > 8 ? Long.parseLong(args[8]) : 5000;
        if (!mode.equals("monitor") && !mode.equals("park")) {
            throw new IllegalArgumentException("MODE: monitor or park, not " + mode);
        }
        if (!THREADS.isCurrentThreadCpuTimeSupported()) {
            throw new IllegalStateException("this JVM cannot measure a thread's CPU time");
        }
        THREADS.setThreadCpuTimeEnabled(true);

        Random rng = new Random(seed);
        boolean[] slow = new boolean[calls];
        int block = calls / slowCount;
        for (int b = 0; b < slowCount; b++) {  // one per block, away from its edges
            slow[b * block + block / 8 + rng.nextInt(block - block / 4)] = true;
        }
        List<Call> plan = new ArrayList<>();
        for (int i = 0; i < calls; i++) {
            plan.add(new Call(slow[i], slow[i] ? "central"
                : TYPICAL_WAREHOUSES[rng.nextInt(TYPICAL_WAREHOUSES.length)],
                String.format("%016x", rng.nextLong()), 1 + rng.nextInt(5),
                typicalMs - 10 + rng.nextInt(21)));
        }
        Map<String, Warehouse> warehouses = new HashMap<>();
        for (String w : new String[] {"central", "north", "south", "east"}) {
            warehouses.put(w, new Warehouse(w));
        }
        boolean parked = mode.equals("park");
        StockRefresher refresher = new StockRefresher(warehouses.get("central"), holdMs, parked);
        refresher.start();

        for (int i = 0; i < 20; i++) {  // warm-up, outside any span: the JIT compiles them
            priceItems(10);
            buildReceipt(i);
            reserve(warehouses.get("north"), parked);
        }
        Tracer tracer = GlobalOpenTelemetry.getTracer("spanprof.gremlin");
        String[] lines = new String[calls];
        AtomicInteger next = new AtomicInteger();
        List<Thread> threads = new ArrayList<>();
        for (int w = 1; w <= workers; w++) {
            threads.add(new Thread(() -> {
                for (int i = next.getAndIncrement(); i < calls; i = next.getAndIncrement()) {
                    lines[i] = placeOrder(tracer, plan.get(i), warehouses, refresher, parked);
                    sleepMs(pauseMs);
                }
            }, "worker-" + w));
        }
        threads.forEach(Thread::start);
        for (Thread t : threads) {
            t.join();
        }
        System.out.println("{\"mode\": \"" + mode + "\", \"calls\": ["
            + String.join(", ", lines) + "]}");
        System.out.flush();
        Thread.sleep(lingerMs);
    }

    /** One call: root span "place_order"; its figures as a JSON object. */
    private static String placeOrder(Tracer tracer, Call call, Map<String, Warehouse> warehouses,
                                     StockRefresher refresher, boolean parked) {
        long t0 = System.nanoTime();
        long cpu0 = cpuNow();
        Span span = tracer.spanBuilder("place_order").setNoParent().setSpanKind(SpanKind.SERVER)
            .setAttribute("warehouse", call.warehouse()).setAttribute("order.id", call.orderId())
            .setAttribute("cart.size", call.cartSize()).startSpan();
        try (Scope ignored = span.makeCurrent()) {
            priceItems(call.typicalMs());
            buildReceipt(call.cartSize());
            Warehouse w = warehouses.get(call.warehouse());
            if (call.slow()) {
                refresher.refreshNow();  // returns once the refresher holds central's lock
            }
            reserve(w, parked);
        } finally {
            span.end();
        }
        long duration = System.nanoTime() - t0;
        long cpu = cpuNow() - cpu0;
        Thread me = Thread.currentThread();
        return String.format("{\"trace_id\": \"%s\", \"span_id\": \"%s\", \"slow\": %b, "
            + "\"thread\": \"%s\", \"thread_id\": %d, \"duration_ns\": %d, \"cpu_ns\": %d}",
            span.getSpanContext().getTraceId(), span.getSpanContext().getSpanId(), call.slow(),
            me.getName(), me.getId(), duration, cpu);
    }

    private static void reserve(Warehouse w, boolean parked) {
        if (parked) {
            reserveStockParked(w);
        } else {
            reserveStock(w);
        }
    }

    /** Takes one item from the warehouse's stock under its monitor. */
    static void reserveStock(Warehouse w) {
        synchronized (w) {
            w.stock--;
        }
    }

    /** Takes one item from the warehouse's stock under its ReentrantLock. */
    static void reserveStockParked(Warehouse w) {
        w.lock.lock();
        try {
            w.stock--;
        } finally {
            w.lock.unlock();
        }
    }

    /**
     * The holder: a thread that, when asked, takes the central warehouse's lock and holds
     * it for {@code holdMs} in {@link #refreshCentralStock}, as a cache refresh doing
     * remote I/O under its lock would.
     */
    static final class StockRefresher extends Thread {
        private final Warehouse central;
        private final long holdMs;
        private final boolean parked;
        private final BlockingQueue<CountDownLatch> asked = new LinkedBlockingQueue<>();

        StockRefresher(Warehouse central, long holdMs, boolean parked) {
            super("stock-refresher");
            setDaemon(true);
            this.central = central;
            this.holdMs = holdMs;
            this.parked = parked;
        }

        @Override
        public void run() {
            try {
                while (true) {
                    CountDownLatch holding = asked.take();
                    refreshCentralStock(holding);
                }
            } catch (InterruptedException e) {
                Thread.currentThread().interrupt();
            }
        }

        /** Holds central's lock for holdMs (sleeping: the fetch), once it says it holds. */
        void refreshCentralStock(CountDownLatch holding) throws InterruptedException {
            if (parked) {
                central.lock.lock();
                try {
                    holding.countDown();
                    Thread.sleep(holdMs);
                    central.stock = 1_000_000;
                } finally {
                    central.lock.unlock();
                }
            } else {
                synchronized (central) {
                    holding.countDown();
                    Thread.sleep(holdMs);
                    central.stock = 1_000_000;
                }
            }
        }

        /** Returns once the refresher holds central's lock. */
        void refreshNow() {
            CountDownLatch holding = new CountDownLatch(1);
            asked.add(holding);
            // yield, not park: waiting here must not be a lock wait of its own
            while (holding.getCount() > 0) {
                Thread.yield();
            }
        }
    }

    private static void sleepMs(long ms) {
        try {
            Thread.sleep(ms);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
        }
    }

    private static long cpuNow() {
        return THREADS.getCurrentThreadCpuTime();
    }

    /** Every call's work: FNV-1a over integers until this thread has used ms of CPU time. */
    static long priceItems(long ms) {
        long end = cpuNow() + ms * 1_000_000L;
        long h = 0xcbf29ce484222325L;
        while (cpuNow() < end) {
            for (int i = 0; i < 50_000; i++) {
                h = (h ^ i) * 0x100000001b3L;
            }
        }
        sink += h;
        return h;
    }

    /** Every call's allocation: a receipt of some 256 KiB per cart item. */
    static long buildReceipt(int items) {
        long sum = 0;
        for (int i = 0; i < items; i++) {
            byte[] line = new byte[256 * 1024];
            line[i % line.length] = (byte) i;
            sum += line[i % line.length];
        }
        sink += sum;
        return sum;
    }
}
