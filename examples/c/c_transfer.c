/* A C program on Ferry's C API (include/ferry/ferry_c.h): two engines in one
 * process -- a target with the embedded metadata service and an initiator
 * that joins it -- WRITE a pattern into the target's buffer, READ it back,
 * check it, and notify the target. Prints what it did; exits 0 only if
 * every byte matched. Built and run by CI (examples/c:c_transfer_test). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry/ferry_c.h"

#define LEN (1 << 20)

/* Prints the status and exits if it is an error. */
static void check(ferry_status* s, const char* what) {
  if (s == NULL) return;
  fprintf(stderr, "%s: code %d: %s\n", what, ferry_status_code(s),
          ferry_status_message(s));
  ferry_status_free(s);
  exit(1);
}

static ferry_engine* start(const char* name, const char* metadata) {
  ferry_options* o = ferry_options_new();
  check(ferry_options_set(o, "local_segment_name", name), "option");
  check(ferry_options_set(o, "listen_host", "127.0.0.1"), "option");
  check(ferry_options_set(o, "metadata_endpoint", metadata), "option");
  ferry_engine* e = NULL;
  check(ferry_engine_new(o, &e), "ferry_engine_new");
  ferry_options_free(o);
  return e;
}

int main(void) {
  ferry_engine* target = start("c-target", "embedded");
  char md[256];
  ferry_engine_metadata_address(target, md, sizeof(md));
  ferry_engine* initiator = start("c-initiator", md);

  uint8_t* remote = calloc(LEN, 1);
  uint8_t* local = malloc(2 * LEN);
  for (size_t i = 0; i < LEN; ++i) local[i] = (uint8_t)(i * 7 + 3);
  memset(local + LEN, 0, LEN);
  check(ferry_register_memory(target, remote, LEN, "cpu:0", 1), "register");
  check(ferry_register_memory(initiator, local, 2 * LEN, "cpu:0", 0),
        "register");

  ferry_segment seg;
  check(ferry_open_segment(initiator, "c-target", &seg), "open");
  ferry_batch batch;
  check(ferry_batch_new(initiator, 2, &batch), "batch");
  ferry_request write = {FERRY_WRITE, local, seg, (uint64_t)(uintptr_t)remote,
                         LEN};
  check(ferry_submit(initiator, batch, &write, 1), "submit write");
  ferry_batch_status st;
  check(ferry_batch_wait(initiator, batch, 10000, &st), "wait write");
  ferry_request read = {FERRY_READ, local + LEN, seg,
                        (uint64_t)(uintptr_t)remote, LEN};
  check(ferry_submit(initiator, batch, &read, 1), "submit read");
  check(ferry_batch_wait(initiator, batch, 10000, &st), "wait read");
  if (st.state != FERRY_COMPLETED) {
    ferry_status* err = NULL;
    check(ferry_request_status(initiator, batch, 1, NULL, NULL, &err),
          "status");
    check(err, "read");
  }
  check(ferry_batch_free(initiator, batch), "free batch");
  if (memcmp(local, local + LEN, LEN) != 0 || memcmp(local, remote, LEN)) {
    fprintf(stderr, "data mismatch\n");
    return 1;
  }
  const char msg[] = "layer=0 ready";
  check(
      ferry_send_notification(initiator, seg, "kv-ready", msg, sizeof(msg) - 1),
      "notify");
  ferry_notification* got = NULL;
  size_t n = 0;
  check(ferry_get_notifications(target, &got, &n), "notifications");
  if (n != 1 || strcmp(got[0].message, msg) != 0 ||
      strcmp(got[0].from_segment, "c-initiator") != 0) {
    fprintf(stderr, "notification not received\n");
    return 1;
  }
  printf("wrote and read back %d bytes; notification '%s' from %s (%s, %s)\n",
         LEN, got[0].message, got[0].from_segment, got[0].sender_address,
         got[0].sender_verified ? "verified" : "unverified");
  ferry_notifications_free(got, n);

  /* Errors come back as codes with messages. */
  ferry_segment none;
  ferry_status* s = ferry_open_segment(initiator, "no-such-segment", &none);
  if (ferry_status_code(s) != FERRY_NOT_FOUND) {
    fprintf(stderr, "expected NOT_FOUND, got %d\n", ferry_status_code(s));
    return 1;
  }
  printf("an unknown segment: %s\n", ferry_status_message(s));
  ferry_status_free(s);

  check(ferry_unregister_memory(initiator, local), "unregister");
  check(ferry_unregister_memory(target, remote), "unregister");
  ferry_engine_free(initiator);
  ferry_engine_free(target);
  free(local);
  free(remote);
  return 0;
}
