/* nnx_es power-loss tracer: an LD_PRELOAD shim recording the persistence operations a process
 * makes under one directory tree, with their data (nnx_es/testing/tracer.py builds and reads it).
 *
 * Inactive unless NNX_ES_TRACE_FILE (the trace, appended to) and NNX_ES_TRACE_ROOT (an absolute,
 * resolved directory) are both set when the library is loaded. Below Python, so LMDB's own writes
 * from C are seen: open/open64/openat/openat64/creat/creat64, write/pwrite/pwrite64/writev/
 * pwritev/pwritev64/pwritev2, ftruncate/ftruncate64, fsync/fdatasync, rename/renameat/renameat2,
 * unlink/unlinkat, mkdir/mkdirat, rmdir, dup/dup2/dup3, close; a shared writable mmap of a traced
 * file (MDB_WRITEMAP) is recorded as unsupported (its writes would not be seen). lseek is not
 * wrapped: the offset of a write/writev is read from the kernel after the call (SEEK_CUR minus
 * the bytes written), which is what lseek+writev amounts to. msync is not wrapped: with no shared
 * writable map of a traced file (recorded as unsupported) it has nothing of ours to flush. lock.mdb
 * is ignored (LMDB reinitialises it on open).
 *
 * A traced call runs under one mutex together with its record, so the trace is a linearisation
 * of what the threads did. Each record is one write(2) through syscall(SYS_write) (never our own
 * write: no recursion) of a 48-byte header and its strings and data:
 *   u32 total length, u8 op, 3 pad, i32 fd, i32 flags, i64 offset, i64 arg, u32 n1, u32 n2, u64 nd
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

enum { OP_OPEN = 1, OP_WRITE, OP_TRUNC, OP_FSYNC, OP_FDATASYNC, OP_RENAME, OP_UNLINK, OP_MKDIR, OP_RMDIR,
       OP_CLOSE, OP_UNSUPPORTED };

#define FDMAX 65536

struct header { uint32_t len; uint8_t op, pad[3]; int32_t fd, flags; int64_t off, arg; uint32_t n1, n2; uint64_t nd; };

static int trace_fd = -1;
static char root[PATH_MAX];
static size_t root_len;
static char *paths[FDMAX];
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

#define REAL(name) static __typeof__(name) *real_##name
REAL(open); REAL(open64); REAL(openat); REAL(openat64); REAL(creat); REAL(creat64);
REAL(write); REAL(pwrite); REAL(pwrite64); REAL(writev); REAL(pwritev); REAL(pwritev64); REAL(pwritev2);
REAL(ftruncate); REAL(ftruncate64); REAL(fsync); REAL(fdatasync); REAL(rename); REAL(renameat); REAL(renameat2);
REAL(unlink); REAL(unlinkat); REAL(mkdir); REAL(mkdirat); REAL(rmdir); REAL(close); REAL(dup); REAL(dup2);
REAL(dup3); REAL(mmap); REAL(mmap64);
#define LOAD(name) (real_##name = (__typeof__(name) *)dlsym(RTLD_NEXT, #name))

static int loaded;
static void load_all(void) {
    LOAD(open); LOAD(open64); LOAD(openat); LOAD(openat64); LOAD(creat); LOAD(creat64); LOAD(write); LOAD(pwrite);
    LOAD(pwrite64); LOAD(writev); LOAD(pwritev); LOAD(pwritev64); LOAD(pwritev2); LOAD(ftruncate);
    LOAD(ftruncate64); LOAD(fsync); LOAD(fdatasync); LOAD(rename); LOAD(renameat); LOAD(renameat2); LOAD(unlink);
    LOAD(unlinkat); LOAD(mkdir); LOAD(mkdirat); LOAD(rmdir); LOAD(close); LOAD(dup); LOAD(dup2); LOAD(dup3);
    LOAD(mmap); LOAD(mmap64);
    loaded = 1;
}
#define ENSURE() do { if (!loaded) load_all(); } while (0)

__attribute__((constructor)) static void init(void) {
    ENSURE();
    const char *file = getenv("NNX_ES_TRACE_FILE"), *r = getenv("NNX_ES_TRACE_ROOT");
    if (!file || !r || !*file || r[0] != '/' || strlen(r) >= sizeof root) return;
    strcpy(root, r);
    root_len = strlen(root);
    while (root_len > 1 && root[root_len - 1] == '/') root[--root_len] = 0;
    trace_fd = (int)syscall(SYS_openat, AT_FDCWD, file, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
}

/* ---- paths ---------------------------------------------------------------------------- */

static void normalize(char *p) { /* lexical: "//", "/./", "/../" */
    char out[PATH_MAX]; size_t o = 0; const char *s = p;
    while (*s) {
        while (*s == '/') s++;
        if (!*s) break;
        const char *e = strchr(s, '/'); size_t n = e ? (size_t)(e - s) : strlen(s);
        if (n == 1 && s[0] == '.') { s += n; continue; }
        if (n == 2 && s[0] == '.' && s[1] == '.') { while (o > 0 && out[--o] != '/') {} s += n; continue; }
        if (o + n + 2 >= sizeof out) return;
        out[o++] = '/'; memcpy(out + o, s, n); o += n; s += n;
    }
    if (o == 0) out[o++] = '/';
    out[o] = 0; strcpy(p, out);
}

/* the absolute path of (dirfd, path) into out; 1 when it lies under the root (and is not lock.mdb) */
static int resolve(int dirfd, const char *path, char *out) {
    if (trace_fd < 0 || !path) return 0;
    if (path[0] == '/') {
        if (strlen(path) >= PATH_MAX) return 0;
        strcpy(out, path);
    } else {
        char base[PATH_MAX];
        if (dirfd == AT_FDCWD) { if (!getcwd(base, sizeof base)) return 0; }
        else if (dirfd >= 0 && dirfd < FDMAX && paths[dirfd]) strcpy(base, paths[dirfd]);
        else {
            char link[64]; snprintf(link, sizeof link, "/proc/self/fd/%d", dirfd);
            ssize_t n = readlink(link, base, sizeof base - 1);
            if (n < 0) return 0;
            base[n] = 0;
        }
        if (strlen(base) + strlen(path) + 2 >= PATH_MAX) return 0;
        strcat(base, "/"); strcat(base, path); strcpy(out, base);
    }
    normalize(out);
    size_t n = strlen(out);
    if (strncmp(out, root, root_len) != 0 || (out[root_len] != '/' && out[root_len] != 0)) return 0;
    if (n >= 9 && strcmp(out + n - 9, "/lock.mdb") == 0) return 0;
    return 1;
}

static int traced(int fd) { return trace_fd >= 0 && fd >= 0 && fd < FDMAX && paths[fd] != NULL; }

/* ---- records (called with mu held) ---------------------------------------------------- */

static void emit(int op, int fd, int flags, int64_t off, int64_t arg, const char *p1, const char *p2,
                 const struct iovec *iov, int iovcnt, uint64_t nd) {
    struct header h; memset(&h, 0, sizeof h);
    size_t n1 = p1 ? strlen(p1) : 0, n2 = p2 ? strlen(p2) : 0;
    size_t total = sizeof h + n1 + n2 + nd;
    char *buf = malloc(total);
    if (!buf) abort(); /* a trace with a hole would be a lie */
    h.len = (uint32_t)total; h.op = (uint8_t)op; h.fd = fd; h.flags = flags; h.off = off; h.arg = arg;
    h.n1 = (uint32_t)n1; h.n2 = (uint32_t)n2; h.nd = nd;
    char *w = buf; memcpy(w, &h, sizeof h); w += sizeof h;
    if (n1) { memcpy(w, p1, n1); w += n1; }
    if (n2) { memcpy(w, p2, n2); w += n2; }
    for (int i = 0; i < iovcnt && nd; i++) {
        size_t take = iov[i].iov_len < nd ? iov[i].iov_len : nd;
        memcpy(w, iov[i].iov_base, take); w += take; nd -= take;
    }
    for (size_t done = 0; done < total;) {
        long k = syscall(SYS_write, trace_fd, buf + done, total - done);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) abort();
        done += (size_t)k;
    }
    free(buf);
}

static void track(int fd, const char *p) {
    if (fd < 0 || fd >= FDMAX) return;
    free(paths[fd]);
    paths[fd] = p ? strdup(p) : NULL;
}

/* ---- opens ------------------------------------------------------------------------------ */

static int traced_open(int dirfd, const char *path, int flags, mode_t mode, int which) {
    char abs[PATH_MAX];
    int inside = resolve(dirfd, path, abs);
    if (!inside) {
        switch (which) {
        case 0: return real_open(path, flags, mode);
        case 1: return real_open64(path, flags, mode);
        case 2: return real_openat(dirfd, path, flags, mode);
        default: return real_openat64(dirfd, path, flags, mode);
        }
    }
    pthread_mutex_lock(&mu);
    int existed = faccessat(AT_FDCWD, abs, F_OK, 0) == 0;
    int fd;
    switch (which) {
    case 0: fd = real_open(path, flags, mode); break;
    case 1: fd = real_open64(path, flags, mode); break;
    case 2: fd = real_openat(dirfd, path, flags, mode); break;
    default: fd = real_openat64(dirfd, path, flags, mode); break;
    }
    int saved = errno;
    if (fd >= 0) {
        track(fd, abs);
        emit(OP_OPEN, fd, flags, 0, !existed && (flags & O_CREAT), abs, NULL, NULL, 0, 0);
    }
    pthread_mutex_unlock(&mu);
    errno = saved;
    return fd;
}

#define MODE_ARG(flags, mode) \
    mode_t mode = 0; \
    if ((flags) & (O_CREAT | O_TMPFILE)) { va_list ap; va_start(ap, flags); mode = (mode_t)va_arg(ap, int); va_end(ap); }

int open(const char *path, int flags, ...) { ENSURE(); MODE_ARG(flags, mode); return traced_open(AT_FDCWD, path, flags, mode, 0); }
int open64(const char *path, int flags, ...) { ENSURE(); MODE_ARG(flags, mode); return traced_open(AT_FDCWD, path, flags, mode, 1); }
int openat(int d, const char *path, int flags, ...) { ENSURE(); MODE_ARG(flags, mode); return traced_open(d, path, flags, mode, 2); }
int openat64(int d, const char *path, int flags, ...) { ENSURE(); MODE_ARG(flags, mode); return traced_open(d, path, flags, mode, 3); }
int creat(const char *path, mode_t mode) { ENSURE(); return traced_open(AT_FDCWD, path, O_CREAT | O_WRONLY | O_TRUNC, mode, 0); }
int creat64(const char *path, mode_t mode) { ENSURE(); return traced_open(AT_FDCWD, path, O_CREAT | O_WRONLY | O_TRUNC, mode, 1); }

/* ---- writes ----------------------------------------------------------------------------- */

/* off < 0: the descriptor's own offset (read back from the kernel after the call) */
static ssize_t after_write(int fd, ssize_t n, int64_t off, const struct iovec *iov, int iovcnt) {
    if (n > 0) {
        if (off < 0) off = (int64_t)syscall(SYS_lseek, fd, 0, SEEK_CUR) - n;
        emit(OP_WRITE, fd, 0, off, n, NULL, NULL, iov, iovcnt, (uint64_t)n);
    }
    return n;
}

#define WRITE_BODY(call, off, iov, cnt) \
    if (!traced(fd)) return call; \
    pthread_mutex_lock(&mu); ssize_t n = call; int saved = errno; \
    after_write(fd, n, off, iov, cnt); pthread_mutex_unlock(&mu); errno = saved; return n;

ssize_t write(int fd, const void *buf, size_t count) { ENSURE();
    struct iovec v = {(void *)buf, count};
    WRITE_BODY(real_write(fd, buf, count), -1, &v, 1)
}
ssize_t pwrite(int fd, const void *buf, size_t count, off_t off) { ENSURE();
    struct iovec v = {(void *)buf, count};
    WRITE_BODY(real_pwrite(fd, buf, count, off), off, &v, 1)
}
ssize_t pwrite64(int fd, const void *buf, size_t count, off64_t off) { ENSURE();
    struct iovec v = {(void *)buf, count};
    WRITE_BODY(real_pwrite64(fd, buf, count, off), off, &v, 1)
}
ssize_t writev(int fd, const struct iovec *iov, int cnt) { ENSURE(); WRITE_BODY(real_writev(fd, iov, cnt), -1, iov, cnt) }
ssize_t pwritev(int fd, const struct iovec *iov, int cnt, off_t off) { ENSURE();
    WRITE_BODY(real_pwritev(fd, iov, cnt, off), off, iov, cnt)
}
ssize_t pwritev64(int fd, const struct iovec *iov, int cnt, off64_t off) { ENSURE();
    WRITE_BODY(real_pwritev64(fd, iov, cnt, off), off, iov, cnt)
}
ssize_t pwritev2(int fd, const struct iovec *iov, int cnt, off_t off, int fl) { ENSURE();
    WRITE_BODY(real_pwritev2(fd, iov, cnt, off, fl), off, iov, cnt)
}

#define FD_OP(call, op, arg) \
    if (!traced(fd)) return call; \
    pthread_mutex_lock(&mu); int r = call; int saved = errno; \
    if (r == 0) emit(op, fd, 0, 0, arg, NULL, NULL, NULL, 0, 0); \
    pthread_mutex_unlock(&mu); errno = saved; return r;

int ftruncate(int fd, off_t len) { ENSURE(); FD_OP(real_ftruncate(fd, len), OP_TRUNC, len) }
int ftruncate64(int fd, off64_t len) { ENSURE(); FD_OP(real_ftruncate64(fd, len), OP_TRUNC, len) }
int fsync(int fd) { ENSURE(); FD_OP(real_fsync(fd), OP_FSYNC, 0) }
int fdatasync(int fd) { ENSURE(); FD_OP(real_fdatasync(fd), OP_FDATASYNC, 0) }

int close(int fd) { ENSURE();
    if (!traced(fd)) return real_close(fd);
    pthread_mutex_lock(&mu);
    emit(OP_CLOSE, fd, 0, 0, 0, NULL, NULL, NULL, 0, 0);
    track(fd, NULL);
    int r = real_close(fd);
    int saved = errno;
    pthread_mutex_unlock(&mu);
    errno = saved;
    return r;
}

static int dup_tracked(int old, int fd) {
    if (fd >= 0 && fd != old) {
        if (traced(fd)) emit(OP_CLOSE, fd, 0, 0, 0, NULL, NULL, NULL, 0, 0);
        track(fd, NULL);
        if (traced(old)) { track(fd, paths[old]); emit(OP_OPEN, fd, O_RDWR, 0, 0, paths[fd], NULL, NULL, 0, 0); }
    }
    return fd;
}
int dup(int old) { ENSURE(); pthread_mutex_lock(&mu); int r = dup_tracked(old, real_dup(old)); pthread_mutex_unlock(&mu); return r; }
int dup2(int old, int fd) { ENSURE();
    pthread_mutex_lock(&mu); int r = dup_tracked(old, real_dup2(old, fd)); pthread_mutex_unlock(&mu); return r;
}
int dup3(int old, int fd, int fl) { ENSURE();
    pthread_mutex_lock(&mu); int r = dup_tracked(old, real_dup3(old, fd, fl)); pthread_mutex_unlock(&mu); return r;
}

static void check_map(int prot, int flags, int fd) {
    if ((prot & PROT_WRITE) && (flags & MAP_SHARED) && traced(fd)) {
        pthread_mutex_lock(&mu);
        emit(OP_UNSUPPORTED, fd, 0, 0, 0, paths[fd], "a shared writable mmap (MDB_WRITEMAP?)", NULL, 0, 0);
        pthread_mutex_unlock(&mu);
    }
}
void *mmap(void *a, size_t len, int prot, int flags, int fd, off_t off) {
    check_map(prot, flags, fd); return real_mmap(a, len, prot, flags, fd, off);
}
void *mmap64(void *a, size_t len, int prot, int flags, int fd, off64_t off) {
    check_map(prot, flags, fd); return real_mmap64(a, len, prot, flags, fd, off);
}

/* ---- directory entries ------------------------------------------------------------------ */

#define PATH_OP(dirfd, path, call, op, arg) \
    char abs[PATH_MAX]; \
    if (!resolve(dirfd, path, abs)) return call; \
    pthread_mutex_lock(&mu); int r = call; int saved = errno; \
    if (r == 0) emit(op, -1, 0, 0, arg, abs, NULL, NULL, 0, 0); \
    pthread_mutex_unlock(&mu); errno = saved; return r;

int unlink(const char *p) { ENSURE(); PATH_OP(AT_FDCWD, p, real_unlink(p), OP_UNLINK, 0) }
int rmdir(const char *p) { ENSURE(); PATH_OP(AT_FDCWD, p, real_rmdir(p), OP_RMDIR, 0) }
int unlinkat(int d, const char *p, int fl) { ENSURE();
    PATH_OP(d, p, real_unlinkat(d, p, fl), (fl & AT_REMOVEDIR) ? OP_RMDIR : OP_UNLINK, 0)
}
int mkdir(const char *p, mode_t m) { ENSURE(); PATH_OP(AT_FDCWD, p, real_mkdir(p, m), OP_MKDIR, 0) }
int mkdirat(int d, const char *p, mode_t m) { ENSURE(); PATH_OP(d, p, real_mkdirat(d, p, m), OP_MKDIR, 0) }

static int traced_rename(int od, const char *o, int nd, const char *n, unsigned fl, int which) {
    char a[PATH_MAX], b[PATH_MAX];
    int ia = resolve(od, o, a), ib = resolve(nd, n, b);
#define CALL (which == 0 ? real_rename(o, n) : which == 1 ? real_renameat(od, o, nd, n) : real_renameat2(od, o, nd, n, fl))
    if (!ia && !ib) return CALL;
    pthread_mutex_lock(&mu);
    int r = CALL;
    int saved = errno;
    if (r == 0) {
        if (ia && ib) emit(OP_RENAME, -1, (int)fl, 0, 0, a, b, NULL, 0, 0);
        else emit(OP_UNSUPPORTED, -1, 0, 0, 0, ia ? a : b, "a rename across the traced root's boundary", NULL, 0, 0);
    }
    pthread_mutex_unlock(&mu);
    errno = saved;
    return r;
#undef CALL
}
int rename(const char *o, const char *n) { ENSURE(); return traced_rename(AT_FDCWD, o, AT_FDCWD, n, 0, 0); }
int renameat(int od, const char *o, int nd, const char *n) { ENSURE(); return traced_rename(od, o, nd, n, 0, 1); }
int renameat2(int od, const char *o, int nd, const char *n, unsigned fl) { ENSURE(); return traced_rename(od, o, nd, n, fl, 2); }
