/* Source block reads in threads that never hold the GIL (cachefs/read_pool.py explains why).
 *
 * A Pool owns a descriptor of the source's root (a dup), a FIFO of jobs and `threads` POSIX
 * threads. A job is one block read as cachefs.source reads it: the file opened beneath the
 * root with openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS), fstat'ed
 * (a regular file only), pread from `offset` for up to `max_bytes` (to its end), stat'ed
 * again (its size, mtime and inode: `stat_after`), closed. A thread runs the whole job with no
 * Python object in reach, so it needs the GIL for nothing. Finished jobs wait in a list until
 * `completed()`, which the trio thread calls when the pool's eventfd is readable: a thread
 * writes to it only when it finds the list empty, so a burst of completions wakes the trio
 * thread once.
 *
 * The bytes land where they are kept. Given the size the caller expects (`size_hint`, the
 * file's size as last seen), `submit` makes the bytes object then, holding the GIL, and the
 * thread reads into its buffer, which nothing else can reach until `completed()` hands it
 * over (shortened if the read got fewer bytes). Copying each block out of a buffer of the
 * thread's into a new object, on the trio thread, was a fifth of the time its completions
 * took there. Without a hint, for an empty file, or for a file longer than the hint, the
 * thread reads into a buffer of its own, sized by its fstat, and `completed()` copies it.
 *
 * Lifetime: the pool's state is shared by the object and its threads and freed by whichever
 * lets go last. `close()` (or the object's deallocation) drops the queued jobs and the
 * finished reads nobody collected; a thread in a job finishes it (a read may hang on a stuck
 * network file system: nobody waits for it) and exits, and the root descriptor and the
 * eventfd close with the last of them. The bytes object made for a read still running at
 * close is left behind (a thread holds no GIL to release it), at most one per thread.
 */

#define _GNU_SOURCE /* pthread_setname_np */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define STAT_FIELDS 13 /* mode ino dev nlink uid gid size atime_ns mtime_ns ctime_ns blksize blocks rdev */

struct job {
    struct job *next;
    long long ident;
    long long offset, max_bytes, delay_ns;
    PyObject *bytes; /* made by `submit` to be read into (its buffer `room` long), or NULL */
    long long room;
    char path[]; /* NUL-terminated */
};

struct result {
    long long ident;
    int err;          /* 0, or the errno that ended the read */
    PyObject *bytes;  /* the job's, if it had one: the bytes read are at its start */
    char *data;       /* else malloc'd */
    long long nbytes;
    long long before[STAT_FIELDS];
    long long after_size, after_mtime_ns, after_ino; /* what the caller compares */
    long long elapsed_ns; /* from the open to the last fstat */
};

struct pool {
    pthread_mutex_t lock;
    pthread_cond_t work, room;
    struct job *head, *tail;
    /* finished reads: `done` fills while `completed()` empties the other of the two */
    struct result *done, *spare;
    size_t done_count, done_room;
    int root_fd, event_fd;
    int closing;
    int holders; /* the Python object, and each live thread */
};

static void pool_let_go(struct pool *pool) /* called with the lock held; unlocks */
{
    int last = --pool->holders == 0;
    pthread_mutex_unlock(&pool->lock);
    if (!last)
        return;
    /* no job is queued and no read waits in `done`: pool_close took them, with the GIL that
       their bytes objects need, and no thread adds one once it is closing */
    free(pool->done);
    free(pool->spare);
    close(pool->root_fd);
    close(pool->event_fd);
    pthread_cond_destroy(&pool->work);
    pthread_cond_destroy(&pool->room);
    pthread_mutex_destroy(&pool->lock);
    free(pool);
}

static long long ns_of(struct timespec t)
{
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static long long monotonic_ns(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return ns_of(now);
}

/* the source's testing delay (cachefs/source.py `delay_s`) */
static void sleep_ns(long long delay_ns)
{
    if (delay_ns <= 0)
        return;
    struct timespec delay = {delay_ns / 1000000000LL, delay_ns % 1000000000LL};
    while (nanosleep(&delay, &delay) < 0 && errno == EINTR)
        ;
}

static void stat_fields(const struct stat *st, long long *out)
{
    long long fields[STAT_FIELDS] = {
        st->st_mode, (long long)st->st_ino, (long long)st->st_dev, (long long)st->st_nlink,
        st->st_uid, st->st_gid, st->st_size, ns_of(st->st_atim), ns_of(st->st_mtim),
        ns_of(st->st_ctim), st->st_blksize, st->st_blocks, (long long)st->st_rdev};
    memcpy(out, fields, sizeof fields);
}

/* The size, mtime and inode of the file after the read (`res->after_*`), from a statx asking
 * for those three alone, which on FUSE needs no GETATTR round trip after a read
 * (cachefs/read_pool.py); fstat where statx is missing or does not give them. -1 and errno on
 * failure. */
static int stat_after(int fd, struct result *res)
{
    struct statx stx;
    const unsigned int want = STATX_SIZE | STATX_MTIME | STATX_INO;
    if (statx(fd, "", AT_EMPTY_PATH, want, &stx) == 0 && (stx.stx_mask & want) == want) {
        res->after_size = (long long)stx.stx_size;
        res->after_mtime_ns = (long long)stx.stx_mtime.tv_sec * 1000000000LL
                              + stx.stx_mtime.tv_nsec;
        res->after_ino = (long long)stx.stx_ino;
        return 0;
    }
    struct stat st;
    if (fstat(fd, &st) < 0)
        return -1;
    res->after_size = st.st_size;
    res->after_mtime_ns = ns_of(st.st_mtim);
    res->after_ino = (long long)st.st_ino;
    return 0;
}

/* One block read (the file comment); fills `res` (`res->err` on failure). */
static void read_block(int root_fd, const struct job *job, struct result *res)
{
    struct open_how how;
    struct stat st;
    int fd;

    memset(res, 0, sizeof *res);
    res->ident = job->ident;
    res->bytes = job->bytes;
    long long started_ns = monotonic_ns();
    sleep_ns(job->delay_ns); /* before the open and before the read, as the source sleeps */
    memset(&how, 0, sizeof how);
    how.flags = O_RDONLY | O_NONBLOCK | O_NOCTTY | O_NOFOLLOW | O_CLOEXEC;
    how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
    fd = (int)syscall(SYS_openat2, root_fd, job->path, &how, sizeof how);
    if (fd < 0) {
        res->err = errno;
        res->elapsed_ns = monotonic_ns() - started_ns;
        return;
    }
    if (fstat(fd, &st) < 0) {
        res->err = errno;
        goto out;
    }
    if (!S_ISREG(st.st_mode)) {
        res->err = S_ISDIR(st.st_mode) ? EISDIR : EINVAL;
        goto out;
    }
    stat_fields(&st, res->before);
    long long want = st.st_size - job->offset;
    want = want < 0 ? 0 : want < job->max_bytes ? want : job->max_bytes;
    char *into;
    if (job->bytes && want <= job->room) {
        into = PyBytes_AS_STRING(job->bytes);
    } else {
        /* no hint, or a file longer than it (grown since it was last seen, or of a size the
           caller estimated): a buffer of the fstat's size, copied at `completed()`. Stopping
           at the hint gave the caller a read short of the file's size, which it made again
           whole: a second read of each file longer than the mean size it expected */
        into = res->data = malloc(want > 0 ? (size_t)want : 1);
        if (!into) {
            res->err = ENOMEM;
            goto out;
        }
    }
    sleep_ns(job->delay_ns);
    while (res->nbytes < want) { /* network file systems may return short reads */
        ssize_t got = pread(fd, into + res->nbytes, (size_t)(want - res->nbytes),
                            job->offset + res->nbytes);
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0) {
            res->err = errno;
            goto out;
        }
        if (got == 0)
            break;
        res->nbytes += got;
    }
    if (stat_after(fd, res) < 0) {
        res->err = errno;
        goto out;
    }
out:
    res->elapsed_ns = monotonic_ns() - started_ns;
    if (res->err) {
        free(res->data);
        res->data = NULL;
        res->nbytes = 0;
    }
    close(fd);
}

static void *worker(void *arg)
{
    struct pool *pool = arg;
    /* for ps -L, top -H, perf and /proc/PID/task/TID/comm, as cachefs.threads names the
       daemon's Python threads (a thread keeps the program's name otherwise) */
    pthread_setname_np(pthread_self(), "cachefs-read");
    pthread_mutex_lock(&pool->lock);
    for (;;) {
        while (!pool->head && !pool->closing)
            pthread_cond_wait(&pool->work, &pool->lock);
        if (pool->closing)
            break;
        struct job *job = pool->head;
        pool->head = job->next;
        if (!pool->head)
            pool->tail = NULL;
        int root_fd = pool->root_fd;
        pthread_mutex_unlock(&pool->lock);

        struct result res;
        read_block(root_fd, job, &res);
        free(job);

        pthread_mutex_lock(&pool->lock);
        /* full only if more reads ran than the pool has threads (the caller keeps them
           fewer): wait for `completed()` to take the list */
        while (pool->done_count == pool->done_room && !pool->closing)
            pthread_cond_wait(&pool->room, &pool->lock);
        if (pool->closing) {
            free(res.data); /* res.bytes is left behind (the file comment) */
            break;
        }
        pool->done[pool->done_count++] = res;
        if (pool->done_count == 1) { /* else the trio thread has been woken already */
            uint64_t one = 1;
            if (write(pool->event_fd, &one, sizeof one) < 0) {
                /* only EAGAIN, at a counter near 2^64: readable anyway */
            }
        }
    }
    pool_let_go(pool);
    return NULL;
}

typedef struct {
    PyObject_HEAD
    struct pool *pool; /* NULL once closed */
} PoolObject;

static void pool_close(PoolObject *self)
{
    struct pool *pool = self->pool;
    if (!pool)
        return;
    self->pool = NULL;
    pthread_mutex_lock(&pool->lock);
    /* what holds a bytes object goes here, where the GIL is held (the file comment) */
    for (struct job *job = pool->head, *next; job; job = next) {
        next = job->next;
        Py_XDECREF(job->bytes);
        free(job);
    }
    pool->head = pool->tail = NULL;
    for (size_t i = 0; i < pool->done_count; i++) {
        Py_CLEAR(pool->done[i].bytes);
        free(pool->done[i].data);
        pool->done[i].data = NULL;
    }
    pool->done_count = 0;
    pool->closing = 1;
    pthread_cond_broadcast(&pool->work);
    pthread_cond_broadcast(&pool->room);
    pool_let_go(pool);
}

static int Pool_init(PoolObject *self, PyObject *args, PyObject *kwds)
{
    static char *keywords[] = {"root_fd", "threads", NULL};
    int root_fd, threads;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "ii", keywords, &root_fd, &threads))
        return -1;
    if (threads < 1) {
        PyErr_SetString(PyExc_ValueError, "a read pool needs at least one thread");
        return -1;
    }
    pool_close(self);
    struct pool *pool = calloc(1, sizeof *pool);
    if (!pool) {
        PyErr_NoMemory();
        return -1;
    }
    pool->done_room = (size_t)threads;
    pool->done = calloc(pool->done_room, sizeof *pool->done);
    pool->spare = calloc(pool->done_room, sizeof *pool->spare);
    pool->root_fd = fcntl(root_fd, F_DUPFD_CLOEXEC, 0);
    pool->event_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (!pool->done || !pool->spare || pool->root_fd < 0 || pool->event_fd < 0) {
        if (!pool->done || !pool->spare)
            PyErr_NoMemory();
        else
            PyErr_SetFromErrno(PyExc_OSError);
        if (pool->root_fd >= 0)
            close(pool->root_fd);
        if (pool->event_fd >= 0)
            close(pool->event_fd);
        free(pool->done);
        free(pool->spare);
        free(pool);
        return -1;
    }
    pthread_mutex_init(&pool->lock, NULL);
    pthread_cond_init(&pool->work, NULL);
    pthread_cond_init(&pool->room, NULL);
    pool->holders = 1;
    self->pool = pool;

    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 128 * 1024); /* a read needs a few hundred bytes */
    /* The threads block every signal (they inherit the mask they are created with): a
       signal for the process (the daemon's SIGTERM at unmount) is then handled by one of its
       Python threads, never in the middle of a read, where it interrupted a network file
       system's open or stat (FUSE sends the file system an INTERRUPT) and failed the read
       with EINTR */
    sigset_t all, before;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &before);
    int failed = 0;
    for (int i = 0; i < threads && !failed; i++) {
        pthread_t thread;
        pthread_mutex_lock(&pool->lock);
        pool->holders++;
        pthread_mutex_unlock(&pool->lock);
        failed = pthread_create(&thread, &attr, worker, pool);
        if (failed) {
            pthread_mutex_lock(&pool->lock);
            pool->holders--;
            pthread_mutex_unlock(&pool->lock);
        }
    }
    pthread_sigmask(SIG_SETMASK, &before, NULL);
    pthread_attr_destroy(&attr);
    if (failed) {
        pool_close(self);
        errno = failed;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return 0;
}

static void Pool_dealloc(PoolObject *self)
{
    pool_close(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static struct pool *open_pool(PoolObject *self)
{
    if (!self->pool)
        PyErr_SetString(PyExc_ValueError, "the read pool is closed");
    return self->pool;
}

static PyObject *Pool_submit(PoolObject *self, PyObject *args)
{
    long long ident, offset, max_bytes, delay_ns, size_hint;
    const char *path;
    Py_ssize_t path_len;
    struct pool *pool = open_pool(self);
    if (!pool || !PyArg_ParseTuple(args, "Ly#LLLL", &ident, &path, &path_len, &offset,
                                   &max_bytes, &delay_ns, &size_hint))
        return NULL;
    if ((Py_ssize_t)strlen(path) != path_len) {
        PyErr_SetString(PyExc_ValueError, "a path with a NUL byte");
        return NULL;
    }
    struct job *job = malloc(sizeof *job + (size_t)path_len + 1);
    if (!job)
        return PyErr_NoMemory();
    job->next = NULL;
    job->ident = ident;
    job->offset = offset;
    job->max_bytes = max_bytes;
    job->delay_ns = delay_ns;
    job->bytes = NULL;
    job->room = size_hint < max_bytes ? size_hint : max_bytes;
    if (job->room > 0) { /* (an empty bytes object is shared: none is made for one) */
        job->bytes = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)job->room);
        if (!job->bytes) {
            free(job);
            return NULL;
        }
    }
    memcpy(job->path, path, (size_t)path_len + 1);
    pthread_mutex_lock(&pool->lock);
    if (pool->tail)
        pool->tail->next = job;
    else
        pool->head = job;
    pool->tail = job;
    pthread_mutex_unlock(&pool->lock);
    /* after the unlock: a thread woken while the lock is still held blocks on it at once,
       and the unlock then wakes it a second time (a futex call on the trio thread for each) */
    pthread_cond_signal(&pool->work);
    Py_RETURN_NONE;
}

static PyObject *stat_tuple(const long long *fields)
{
    PyObject *tuple = PyTuple_New(STAT_FIELDS);
    for (int i = 0; tuple && i < STAT_FIELDS; i++) {
        PyObject *value = PyLong_FromLongLong(fields[i]);
        if (!value) {
            Py_CLEAR(tuple);
            break;
        }
        PyTuple_SET_ITEM(tuple, i, value);
    }
    return tuple;
}

/* The result as `completed()` gives it; takes the result's bytes object (a new reference). */
static PyObject *result_tuple(struct result *res)
{
    PyObject *data = res->bytes;
    res->bytes = NULL;
    if (res->err) {
        Py_XDECREF(data);
        return Py_BuildValue("(LiOOOL)", res->ident, res->err, Py_None, Py_None, Py_None,
                             res->elapsed_ns);
    }
    if (res->data) { /* read into the thread's buffer: the object made for the hint unused */
        Py_XDECREF(data);
        data = PyBytes_FromStringAndSize(res->data, res->nbytes);
    } else if (res->nbytes < PyBytes_GET_SIZE(data) && _PyBytes_Resize(&data, res->nbytes) < 0)
        data = NULL; /* (freed by _PyBytes_Resize, MemoryError set) */
    PyObject *before = stat_tuple(res->before);
    PyObject *after = Py_BuildValue("(LLL)", res->after_size, res->after_mtime_ns,
                                    res->after_ino);
    PyObject *tuple = NULL;
    if (data && before && after)
        tuple = Py_BuildValue("(LiOOOL)", res->ident, 0, data, before, after,
                              res->elapsed_ns);
    Py_XDECREF(data);
    Py_XDECREF(before);
    Py_XDECREF(after);
    return tuple;
}

static PyObject *Pool_completed(PoolObject *self, PyObject *Py_UNUSED(ignored))
{
    struct pool *pool = open_pool(self);
    if (!pool)
        return NULL;
    uint64_t count;
    /* the counter first, then the list: a completion after this read writes it again */
    if (read(pool->event_fd, &count, sizeof count) < 0 && errno != EAGAIN)
        return PyErr_SetFromErrno(PyExc_OSError);
    /* only this call touches `spare`, and the GIL makes the calls one at a time */
    pthread_mutex_lock(&pool->lock);
    struct result *taken = pool->done;
    size_t taken_count = pool->done_count;
    pool->done = pool->spare;
    pool->done_count = 0;
    pool->spare = taken;
    pthread_cond_broadcast(&pool->room);
    pthread_mutex_unlock(&pool->lock);

    PyObject *list = PyList_New((Py_ssize_t)taken_count);
    for (size_t i = 0; i < taken_count; i++) {
        PyObject *item = list ? result_tuple(&taken[i]) : NULL;
        if (list && !item && PyErr_ExceptionMatches(PyExc_MemoryError)) {
            /* no memory for its bytes: this read fails (ENOMEM) and the batch's others are
               handed over still (the batch lost left each of its readers waiting forever) */
            PyErr_Clear();
            item = Py_BuildValue("(LiOOOL)", taken[i].ident, ENOMEM, Py_None, Py_None, Py_None,
                                 taken[i].elapsed_ns);
        }
        Py_CLEAR(taken[i].bytes); /* (if no tuple took it) */
        free(taken[i].data);
        taken[i].data = NULL;
        if (list && !item)
            Py_CLEAR(list);
        if (list)
            PyList_SET_ITEM(list, (Py_ssize_t)i, item);
    }
    return list;
}

static PyObject *Pool_fileno(PoolObject *self, PyObject *Py_UNUSED(ignored))
{
    struct pool *pool = open_pool(self);
    return pool ? PyLong_FromLong(pool->event_fd) : NULL;
}

static PyObject *Pool_close(PoolObject *self, PyObject *Py_UNUSED(ignored))
{
    pool_close(self);
    Py_RETURN_NONE;
}

static PyMethodDef Pool_methods[] = {
    {"submit", (PyCFunction)Pool_submit, METH_VARARGS,
     "submit(ident, relpath, offset, max_bytes, delay_ns, size_hint): queue a block read "
     "(size_hint > 0: the bytes expected, read straight into the object returned)"},
    {"completed", (PyCFunction)Pool_completed, METH_NOARGS,
     "completed() -> [(ident, errno, data, stat_before, (size, mtime_ns, ino) after, "
     "elapsed_ns)]: the reads done since the last call"},
    {"fileno", (PyCFunction)Pool_fileno, METH_NOARGS,
     "fileno() -> the eventfd that is readable when reads are done"},
    {"close", (PyCFunction)Pool_close, METH_NOARGS,
     "close(): drop the queued reads; the threads end after the ones they are in"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cachefs._readpool.Pool",
    .tp_doc = "Pool(root_fd, threads): block reads beneath root_fd in threads without the GIL",
    .tp_basicsize = sizeof(PoolObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Pool_init,
    .tp_dealloc = (destructor)Pool_dealloc,
    .tp_methods = Pool_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "cachefs._readpool",
    "Source block reads in threads that never hold the GIL (cachefs/read_pool.py).", -1, NULL,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__readpool(void)
{
    if (PyType_Ready(&PoolType) < 0)
        return NULL;
    PyObject *mod = PyModule_Create(&module);
    if (!mod)
        return NULL;
    Py_INCREF(&PoolType);
    if (PyModule_AddObject(mod, "Pool", (PyObject *)&PoolType) < 0) {
        Py_DECREF(&PoolType);
        Py_DECREF(mod);
        return NULL;
    }
    if (PyModule_AddIntConstant(mod, "STAT_FIELDS", STAT_FIELDS) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
