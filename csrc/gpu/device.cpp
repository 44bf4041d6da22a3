// Backend-neutral parts of the device interface: barrier derivation, counters, file
// mapping.
#include "gpu/device.h"

#include <cerrno>
#include <cstring>
#include <sstream>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace lily::gpu {

namespace {

std::string describe(const Range& r) {
  std::ostringstream s;
  s << "buffer #" << r.buffer->id();
  if (!r.buffer->label().empty()) s << " '" << r.buffer->label() << "'";
  s << " bytes [" << r.offset << ", " << r.offset + r.size << ")";
  return s.str();
}

const Range* first_overlap(const std::vector<Range>& a, const std::vector<Range>& b,
                           const Range** other) {
  for (const Range& x : a)
    for (const Range& y : b)
      if (x.overlaps(y)) {
        *other = &y;
        return &x;
      }
  return nullptr;
}

void check_range(const Dispatch& d, const Range& r, const char* what) {
  if (!r.buffer)
    throw UsageError("dispatch '" + d.label + "': declared " + what + " range has no buffer");
  if (r.offset > r.buffer->size() || r.size > r.buffer->size() - r.offset) {
    std::ostringstream s;
    s << "dispatch '" << d.label << "': declared " << what << " range [" << r.offset << ", "
      << r.offset + r.size << ") exceeds buffer #" << r.buffer->id() << " of "
      << r.buffer->size() << " bytes";
    throw UsageError(s.str());
  }
}

}  // namespace

const StageTracker::Entry* StageTracker::conflict(const Dispatch& d, const char** kind) const {
  const Range* other = nullptr;
  for (const Entry& e : current_) {
    if (first_overlap(d.reads, e.writes, &other)) { *kind = "read-after-write"; return &e; }
    if (first_overlap(d.writes, e.reads, &other)) { *kind = "write-after-read"; return &e; }
    if (first_overlap(d.writes, e.writes, &other)) { *kind = "write-after-write"; return &e; }
  }
  return nullptr;
}

void StageTracker::add(const Dispatch& d) {
  current_.push_back(Entry{d.label, d.reads, d.writes});
}

void ComputePass::start_stage() {
  tracker_.new_stage();
  if (counters_) counters_->barrier_stages += 1;
}

void ComputePass::dispatch(const Dispatch& d_in) {
  if (ended_) throw UsageError("dispatch on a compute pass that has ended");
  if (!d_in.pipeline) throw UsageError("dispatch without a pipeline");
  Dispatch d = d_in;
  if (d.label.empty()) d.label = d.pipeline->name();
  {
    std::ostringstream s;
    s << d.label << " (#" << dispatch_index_ << ")";
    d.label = s.str();
  }
  for (const Range& r : d.reads) check_range(d, r, "read");
  for (const Range& r : d.writes) check_range(d, r, "write");

  if (!any_dispatch_) {
    any_dispatch_ = true;
    start_stage();
  }
  const char* kind = nullptr;
  if (const StageTracker::Entry* e = tracker_.conflict(d, &kind)) {
    if (mode_ == BarrierMode::automatic) {
      encode_barrier();
      start_stage();
    } else {
      // Name both dispatches and the overlapping range.
      const Range* other = nullptr;
      const Range* mine = nullptr;
      if (std::strcmp(kind, "read-after-write") == 0) mine = first_overlap(d.reads, e->writes, &other);
      else if (std::strcmp(kind, "write-after-read") == 0) mine = first_overlap(d.writes, e->reads, &other);
      else mine = first_overlap(d.writes, e->writes, &other);
      std::ostringstream s;
      s << "hazard (" << kind << ") without a barrier: dispatch '" << d.label << "' "
        << describe(*mine) << " conflicts with dispatch '" << e->label << "' "
        << describe(*other) << " in the same barrier stage";
      throw HazardError(s.str());
    }
  }
  tracker_.add(d);
  if (counters_) {
    DispatchRecord rec;
    rec.label = d.label;
    rec.pass = static_cast<uint32_t>(counters_->passes);
    rec.stage = static_cast<uint32_t>(counters_->barrier_stages - 1);
    for (const Range& r : d.reads) rec.bytes_read += r.size;
    for (const Range& r : d.writes) rec.bytes_written += r.size;
    counters_->dispatches += 1;
    counters_->bytes_read += rec.bytes_read;
    counters_->bytes_written += rec.bytes_written;
    counters_->log.push_back(std::move(rec));
  }
  ++dispatch_index_;
  encode_dispatch(d);
}

void ComputePass::barrier() {
  if (ended_) throw UsageError("barrier on a compute pass that has ended");
  if (!any_dispatch_ || tracker_.empty()) return;  // nothing to order against
  encode_barrier();
  start_stage();
}

void ComputePass::end() {
  if (ended_) return;
  ended_ = true;
  if (counters_) counters_->passes += 1;
  encode_end();
}

size_t page_size() {
  static const size_t p = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return p;
}

BufferPtr Device::map_file(const std::string& path, size_t offset, size_t length) {
  if (offset % page_size())
    throw UsageError("map_file('" + path + "'): offset " + std::to_string(offset) +
                     " is not a multiple of the page size " + std::to_string(page_size()));
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error("map_file('" + path + "'): " + std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    throw Error("map_file('" + path + "'): " + std::strerror(e));
  }
  size_t file_size = static_cast<size_t>(st.st_size);
  if (offset > file_size || (length && length > file_size - offset)) {
    ::close(fd);
    throw UsageError("map_file('" + path + "'): range [" + std::to_string(offset) + ", " +
                     std::to_string(offset + length) + ") exceeds the file size " +
                     std::to_string(file_size));
  }
  if (!length) length = file_size - offset;
  if (!length) {
    ::close(fd);
    throw UsageError("map_file('" + path + "'): empty range");
  }
  // Metal's no-copy buffers need a page-aligned pointer and a page-multiple length.
  size_t mapped = (length + page_size() - 1) / page_size() * page_size();
  void* p = ::mmap(nullptr, mapped, PROT_READ, MAP_PRIVATE, fd, static_cast<off_t>(offset));
  int e = errno;
  ::close(fd);
  if (p == MAP_FAILED) throw Error("map_file('" + path + "'): mmap: " + std::strerror(e));
  BufferPtr b = new_buffer_no_copy(p, mapped, [p, mapped] { ::munmap(p, mapped); });
  b->set_label(path);
  return b;
}

}  // namespace lily::gpu
