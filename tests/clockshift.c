/* Shifts a process's wall clock by HALFWAY_CLOCK_SKEW seconds, as on a host whose clock has
 * drifted: loaded with LD_PRELOAD by tests/test_clock_skew.py, it wraps the C library's
 * clock_gettime (CLOCK_REALTIME and its coarse twin), gettimeofday and time, so every wall
 * clock read in the process (Python's time.time, datetime.now, anything in a C extension)
 * is off, while the monotonic clocks and every other process are left alone.
 *
 * Why not Debian's faketime: libfaketime 0.9.10 hangs CPython's timed lock waits
 * (threading.Event.wait with a timeout never returns) unless it leaves the monotonic clock
 * alone, and with FAKETIME_DONT_FAKE_MONOTONIC it makes time.sleep fail with EINVAL. A
 * time namespace cannot help: it offsets only the monotonic and boot clocks. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>

static int (*real_clock_gettime)(clockid_t, struct timespec *);

static long skew(void) {
    const char *s = getenv("HALFWAY_CLOCK_SKEW");
    return s ? atol(s) : 0;
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    if (!real_clock_gettime) real_clock_gettime = dlsym(RTLD_NEXT, "clock_gettime");
    int rc = real_clock_gettime(id, ts);
    if (rc == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) ts->tv_sec += skew();
    return rc;
}

int gettimeofday(struct timeval *tv, void *tz) {
    (void)tz;
    struct timespec ts;
    int rc = clock_gettime(CLOCK_REALTIME, &ts);
    if (rc == 0 && tv) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    return rc;
}

time_t time(time_t *t) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (t) *t = ts.tv_sec;
    return ts.tv_sec;
}
