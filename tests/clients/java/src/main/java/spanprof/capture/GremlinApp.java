package spanprof.capture;

import io.opentelemetry.api.GlobalOpenTelemetry;
import io.opentelemetry.api.trace.Span;
import io.opentelemetry.api.trace.SpanKind;
import io.opentelemetry.api.trace.Tracer;
import io.opentelemetry.context.Scope;

import java.lang.management.ManagementFactory;
import java.lang.management.GarbageCollectorMXBean;
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
 * takes in {@link StockRefresher#refreshCentralStock} just before the call reserves, and
 * holds (a remote fetch: it sleeps holding the lock) until the call waits for it, then
 * {@code HOLD_MS} more: the call waits {@code HOLD_MS}, burning no more CPU than the
 * others. The other calls are for {@code north}, {@code south} or {@code east}.
 * Each worker keeps its own share of those three (a {@link Warehouse} each, its own lock):
 * the typical calls never wait for a lock, however busy the machine, and the only lock
 * wait in the program's spans is the gremlin's (with the two workers sharing them, the
 * typical calls of a run on a busy machine waited some 45 ms in all). {@code MODE} is which
 * lock: {@code monitor} a
 * {@code synchronized} block in {@link #reserveStock} (the JVM's monitor enter: JFR
 * {@code jdk.JavaMonitorEnter}), {@code park} a {@link ReentrantLock} taken in
 * {@link #reserveStockParked} (the thread parks: JFR {@code jdk.ThreadPark}).
 *
 * <p>Before the workers start, the main thread runs a few whole calls ({@link #WARM_UP},
 * root spans "warm_up", on warehouses of their own): the JIT compiles the call's methods and
 * the first spans load the agents' classes then, not in two workers' first calls at once,
 * where one would wait for the other's class-loading lock inside its span. Then it collects
 * the garbage of the agents' start and the warm-up ({@link System#gc()}): with a young
 * generation larger than what the calls allocate (the test's JVM options), no collection
 * stops a worker while they run (the test says why that matters).
 *
 * <p>At the end one JSON line goes to stdout: {@code {"mode", "collections", "calls":
 * [{"trace_id", "span_id", "slow", "thread", "thread_id", "duration_ns", "cpu_ns"}, ...]}},
 * the garbage collections while the workers ran and the calls in call order, durations and
 * thread CPU times as the program measured them around the span's work.
 * Then the program waits {@code LINGER_MS}: the Pyroscope agent uploads every upload
 * interval and not at exit, so the last calls' samples need one more upload.
 */
public final class GremlinApp {
    private static final ThreadMXBean THREADS = ManagementFactory.getThreadMXBean();
    private static final String[] TYPICAL_WAREHOUSES = {"north", "south", "east"};
    private static final String CENTRAL = "central";
    private static final int WARM_UP = 20;
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
            plan.add(new Call(slow[i], slow[i] ? CENTRAL
                : TYPICAL_WAREHOUSES[rng.nextInt(TYPICAL_WAREHOUSES.length)],
                String.format("%016x", rng.nextLong()), 1 + rng.nextInt(5),
                typicalMs - 10 + rng.nextInt(21)));
        }
        boolean parked = mode.equals("park");
        Warehouse central = new Warehouse(CENTRAL);
        StockRefresher refresher = new StockRefresher(central, holdMs, parked);
        refresher.start();

        Tracer tracer = GlobalOpenTelemetry.getTracer("spanprof.gremlin");
        Map<String, Warehouse> spare = shares(central);  // the warm-up's own, for its locks
        for (int i = 0; i < WARM_UP; i++) {  // one thread: nothing waits (class comment)
            placeOrder(tracer, "warm_up", new Call(false, "north", "warm-up", 1 + i % 5, 5),
                       spare, refresher, parked);
        }
        System.gc();  // an empty young generation for the calls (class comment)
        String[] lines = new String[calls];
        AtomicInteger next = new AtomicInteger();
        List<Thread> threads = new ArrayList<>();
        for (int w = 1; w <= workers; w++) {
            Map<String, Warehouse> mine = shares(central);
            threads.add(new Thread(() -> {
                for (int i = next.getAndIncrement(); i < calls; i = next.getAndIncrement()) {
                    lines[i] = placeOrder(tracer, "place_order", plan.get(i), mine, refresher,
                                          parked);
                    sleepMs(pauseMs);
                }
            }, "worker-" + w));
        }
        long collections = collections();
        threads.forEach(Thread::start);
        for (Thread t : threads) {
            t.join();
        }
        collections = collections() - collections;
        System.out.println("{\"mode\": \"" + mode + "\", \"collections\": " + collections
            + ", \"calls\": [" + String.join(", ", lines) + "]}");
        System.out.flush();
        Thread.sleep(lingerMs);
    }

    /**
     * A worker's warehouses: its own share of each typical one (nobody else takes their
     * locks) and the central one, shared with the other workers and the refresher.
     */
    private static Map<String, Warehouse> shares(Warehouse central) {
        Map<String, Warehouse> mine = new HashMap<>();
        for (String w : TYPICAL_WAREHOUSES) {
            mine.put(w, new Warehouse(w));
        }
        mine.put(CENTRAL, central);
        return mine;
    }

    /** One call: a root span {@code name}; its figures as a JSON object. */
    private static String placeOrder(Tracer tracer, String name, Call call,
                                     Map<String, Warehouse> warehouses,
                                     StockRefresher refresher, boolean parked) {
        long t0 = System.nanoTime();
        long cpu0 = cpuNow();
        Span span = tracer.spanBuilder(name).setNoParent().setSpanKind(SpanKind.SERVER)
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

    /** A slow call's request to the refresher: who asks, and the latch it spins on. */
    record Ask(Thread caller, CountDownLatch holding) {}

    /**
     * The holder: a thread that, when asked, takes the central warehouse's lock and holds
     * it in {@link #refreshCentralStock}, as a cache refresh doing remote I/O under its lock
     * would: until the caller waits for the lock, then {@code holdMs} more. Every slow call
     * so waits {@code holdMs}, give or take a millisecond, however late the scheduler lets
     * it reach the lock (holding for {@code holdMs} from the moment it took the lock, a call
     * that got a core 20 ms late on a busy machine waited 280 ms).
     */
    static final class StockRefresher extends Thread {
        private static final long CALLER_TIMEOUT_NS = 5_000_000_000L;
        private final Warehouse central;
        private final long holdMs;
        private final boolean parked;
        private final BlockingQueue<Ask> asked = new LinkedBlockingQueue<>();

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
                    refreshCentralStock(asked.take());
                }
            } catch (InterruptedException e) {
                Thread.currentThread().interrupt();
            }
        }

        /**
         * Takes central's lock, says it holds it, and holds it until the caller waits for
         * it, then holdMs more (sleeping: the fetch).
         */
        void refreshCentralStock(Ask ask) throws InterruptedException {
            if (parked) {
                central.lock.lock();
                try {
                    ask.holding().countDown();
                    awaitWaiting(ask.caller());
                    Thread.sleep(holdMs);
                    central.stock = 1_000_000;
                } finally {
                    central.lock.unlock();
                }
            } else {
                synchronized (central) {
                    ask.holding().countDown();
                    awaitWaiting(ask.caller());
                    Thread.sleep(holdMs);
                    central.stock = 1_000_000;
                }
            }
        }

        /**
         * Until {@code caller} waits for central's lock (5 s at most): blocked on its
         * monitor, or parked in its queue. The profiler's wait begins within microseconds
         * of the state this sees (the JVM marks a thread blocked just before it posts the
         * contended monitor enter the profiler times; a park is timed from the call to park,
         * before the thread's state changes).
         */
        private void awaitWaiting(Thread caller) throws InterruptedException {
            long deadline = System.nanoTime() + CALLER_TIMEOUT_NS;
            while (!waitsForCentral(caller) && System.nanoTime() < deadline) {
                Thread.sleep(1);
            }
        }

        /**
         * The caller's state, read without a safepoint (a ThreadMXBean thread dump would
         * stop the other worker too, every millisecond): past refreshNow, the only lock
         * it can block on is central's.
         */
        private boolean waitsForCentral(Thread caller) {
            if (parked) {
                return central.lock.hasQueuedThread(caller)
                    && caller.getState() == Thread.State.WAITING;
            }
            return caller.getState() == Thread.State.BLOCKED;
        }

        /** Returns once the refresher holds central's lock. */
        void refreshNow() {
            CountDownLatch holding = new CountDownLatch(1);
            asked.add(new Ask(Thread.currentThread(), holding));
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

    /** Garbage collections so far, all collectors. */
    private static long collections() {
        long n = 0;
        for (GarbageCollectorMXBean gc : ManagementFactory.getGarbageCollectorMXBeans()) {
            n += Math.max(0, gc.getCollectionCount());
        }
        return n;
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
