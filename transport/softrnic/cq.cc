// Completion queues and completion channels.
#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstring>

#include "transport/softrnic/softrnic.h"

namespace softrnic {

void PushCompletions(Cq* cq, const ibv_wc* wcs, int n, bool solicited) {
  bool notify = false;
  bool overrun = false;
  {
    ferry::MutexLock lock(&cq->mu);
    for (int i = 0; i < n; ++i) {
      if (cq->count == cq->ring.size()) {
        // Overrun: the CQE is lost, as on hardware; report it once.
        overrun = !cq->overrun;
        cq->overrun = true;
        break;
      }
      cq->ring[(cq->head + cq->count) % cq->ring.size()] = wcs[i];
      ++cq->count;
      if (cq->armed && (!cq->solicited_only || solicited ||
                        wcs[i].status != IBV_WC_SUCCESS)) {
        cq->armed = false;
        notify = true;
      }
    }
  }
  if (overrun) {
    ibv_async_event e{};
    e.event_type = IBV_EVENT_CQ_ERR;
    e.element.cq = &cq->cq;
    PostAsyncEvent(reinterpret_cast<Context*>(cq->cq.context), e);
  }
  if (notify && cq->cq.channel != nullptr) {
    auto* ch = reinterpret_cast<CompChannel*>(cq->cq.channel);
    ibv_cq* p = &cq->cq;
    ssize_t w = ::write(ch->write_fd, &p, sizeof(p));
    (void)w;
  }
}

void PushCompletion(Cq* cq, const ibv_wc& wc, bool solicited) {
  PushCompletions(cq, &wc, 1, solicited);
}

int PollCq(ibv_cq* ibcq, int n, ibv_wc* wc) {
  auto* cq = reinterpret_cast<Cq*>(ibcq);
  ferry::MutexLock lock(&cq->mu);
  if (cq->overrun && cq->count == 0) return -1;  // Report the lost CQEs.
  int got = 0;
  while (got < n && cq->count > 0) {
    wc[got++] = cq->ring[cq->head];
    cq->head = (cq->head + 1) % cq->ring.size();
    --cq->count;
  }
  return got;
}

int ReqNotifyCq(ibv_cq* ibcq, int solicited_only) {
  if (Dead(ibcq->context)) return EIO;
  auto* cq = reinterpret_cast<Cq*>(ibcq);
  ferry::MutexLock lock(&cq->mu);
  if (cq->cq.channel == nullptr) return EINVAL;
  // Arms for the next completion; CQEs already queued do not fire.
  cq->armed = true;
  cq->solicited_only = solicited_only != 0;
  return 0;
}

}  // namespace softrnic

using namespace softrnic;

SOFTRNIC_EXPORT ibv_comp_channel* ibv_create_comp_channel(
    ibv_context* context) {
  if (Dead(context)) {
    errno = EIO;
    return nullptr;
  }
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return nullptr;
  auto* ch = new CompChannel();
  ch->ch.context = context;
  ch->ch.fd = fds[0];
  ch->ch.refcnt = 0;
  ch->write_fd = fds[1];
  return &ch->ch;
}

SOFTRNIC_EXPORT int ibv_destroy_comp_channel(ibv_comp_channel* channel) {
  auto* ch = reinterpret_cast<CompChannel*>(channel);
  if (ch->ch.refcnt != 0) return EBUSY;
  ::close(ch->ch.fd);
  ::close(ch->write_fd);
  delete ch;
  return 0;
}

SOFTRNIC_EXPORT ibv_cq* ibv_create_cq(ibv_context* context, int cqe,
                                      void* cq_context,
                                      ibv_comp_channel* channel,
                                      int comp_vector) {
  if (Dead(context)) {
    errno = EIO;
    return nullptr;
  }
  if (cqe < 1 || cqe > GetProfile().max_cqe || comp_vector < 0 ||
      comp_vector >= context->num_comp_vectors) {
    errno = EINVAL;
    return nullptr;
  }
  auto* cq = new Cq();
  {
    ferry::MutexLock lock(&cq->mu);
    cq->ring.resize(static_cast<size_t>(cqe));
  }
  cq->cq.context = context;
  cq->cq.channel = channel;
  cq->cq.cq_context = cq_context;
  cq->cq.cqe = cqe;
  pthread_mutex_init(&cq->cq.mutex, nullptr);
  pthread_cond_init(&cq->cq.cond, nullptr);
  if (channel != nullptr) {
    pthread_mutex_lock(&context->mutex);
    ++channel->refcnt;
    pthread_mutex_unlock(&context->mutex);
  }
  return &cq->cq;
}

SOFTRNIC_EXPORT int ibv_resize_cq(ibv_cq* ibcq, int cqe) {
  if (Dead(ibcq->context)) return EIO;
  auto* cq = reinterpret_cast<Cq*>(ibcq);
  ferry::MutexLock lock(&cq->mu);
  if (cqe < 1 || cqe > GetProfile().max_cqe ||
      static_cast<size_t>(cqe) < cq->count) {
    return EINVAL;
  }
  std::vector<ibv_wc> ring(static_cast<size_t>(cqe));
  for (size_t i = 0; i < cq->count; ++i) {
    ring[i] = cq->ring[(cq->head + i) % cq->ring.size()];
  }
  cq->ring.swap(ring);
  cq->head = 0;
  cq->cq.cqe = cqe;
  return 0;
}

SOFTRNIC_EXPORT int ibv_destroy_cq(ibv_cq* ibcq) {
  auto* cq = reinterpret_cast<Cq*>(ibcq);
  // Like libibverbs: wait until every delivered event was acknowledged.
  pthread_mutex_lock(&cq->cq.mutex);
  pthread_mutex_unlock(&cq->cq.mutex);
  if (cq->cq.channel != nullptr) {
    pthread_mutex_lock(&cq->cq.context->mutex);
    --cq->cq.channel->refcnt;
    pthread_mutex_unlock(&cq->cq.context->mutex);
  }
  pthread_cond_destroy(&cq->cq.cond);
  pthread_mutex_destroy(&cq->cq.mutex);
  delete cq;
  return 0;
}

SOFTRNIC_EXPORT int ibv_get_cq_event(ibv_comp_channel* channel, ibv_cq** cq,
                                     void** cq_context) {
  ibv_cq* p = nullptr;
  size_t got = 0;
  while (got < sizeof(p)) {
    ssize_t n =
        ::read(channel->fd, reinterpret_cast<char*>(&p) + got, sizeof(p) - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return -1;  // errno from read (EAGAIN if non-blocking).
    got += static_cast<size_t>(n);
  }
  *cq = p;
  *cq_context = p->cq_context;
  return 0;
}

SOFTRNIC_EXPORT void ibv_ack_cq_events(ibv_cq* cq, unsigned int nevents) {
  pthread_mutex_lock(&cq->mutex);
  cq->comp_events_completed += nevents;
  pthread_cond_signal(&cq->cond);
  pthread_mutex_unlock(&cq->mutex);
}
