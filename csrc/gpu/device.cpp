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

std::string describe(const StageTracker::Span& r) {
  std::ostringstream s;
  s << "buffer #" << r.buffer_id;
  if (!r.buffer_label.empty()) s << " '" << r.buffer_label << "'";
  s << " bytes [" << r.offset << ", " << r.offset + r.size << ")";
  return s.str();
}

std::vector<StageTracker::Span> spans(const std::vector<Range>& rs) {
  std::vector<StageTracker::Span> v;
  v.reserve(rs.size());
  for (const Range& r : rs) v.push_back(StageTracker::span(r));
  return v;
}

bool first_overlap(const std::vector<StageTracker::Span>& a, const std::vector<StageTracker::Span>& b,
                   StageTracker::Span* mine, StageTracker::Span* theirs) {
  for (const auto& x : a)
    for (const auto& y : b)
      if (x.overlaps(y)) {
        *mine = x;
        *theirs = y;
        return true;
      }
  return false;
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

// Metal requires a buffer bound at [[buffer(n)]] to be aligned to the parameter's pointee
// type at its offset; the simulator would fault on a misaligned vector access.
void check_alignment(const Dispatch& d, const Binding& b) {
  if (b.kind != Binding::Kind::buffer) return;
  BufferParameter p = d.pipeline->buffer_parameter(b.index);
  if (p.alignment <= 1 || b.offset % p.alignment == 0) return;
  std::ostringstream s;
  s << "kernel '" << d.pipeline->name() << "' (dispatch '" << d.label << "'): buffer(" << b.index
    << ") is bound at offset " << b.offset << ", which is not a multiple of " << p.alignment
    << ", the required alignment of parameter ";
  if (!p.declaration.empty()) s << "'" << p.declaration << "'";
  else s << b.index;
  throw UsageError(s.str());
}

}  // namespace

StageTracker::Span StageTracker::span(const Range& r) {
  Span s;
  s.buffer_id = r.buffer->id();
  s.offset = r.offset;
  s.size = r.size;
  s.buffer_label = r.buffer->label();
  return s;
}

StageTracker::Conflict StageTracker::conflict(const Dispatch& d) const {
  Conflict c;
  if (current_.empty()) return c;
  std::vector<Span> reads = spans(d.reads), writes = spans(d.writes);
  for (const Entry& e : current_) {
    if (first_overlap(reads, e.writes, &c.mine, &c.theirs)) c.kind = "read-after-write";
    else if (first_overlap(writes, e.reads, &c.mine, &c.theirs)) c.kind = "write-after-read";
    else if (first_overlap(writes, e.writes, &c.mine, &c.theirs)) c.kind = "write-after-write";
    if (c.kind) {
      c.entry = &e;
      return c;
    }
  }
  return c;
}

void StageTracker::add(const Dispatch& d) {
  current_.push_back(Entry{d.label, spans(d.reads), spans(d.writes)});
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
  for (const Binding& b : d.bindings) check_alignment(d, b);
  validate(d);

  if (!any_dispatch_) {
    any_dispatch_ = true;
    start_stage();
  }
  StageTracker::Conflict c = tracker_.conflict(d);
  if (c.entry) {
    if (mode_ == BarrierMode::automatic) {
      encode_barrier();
      start_stage();
    } else {
      // Name both dispatches and the overlapping ranges.
      std::ostringstream s;
      s << "hazard (" << c.kind << ") without a barrier: dispatch '" << d.label << "' "
        << describe(c.mine) << " conflicts with dispatch '" << c.entry->label << "' "
        << describe(c.theirs) << " in the same barrier stage";
      throw HazardError(s.str());
    }
  }
  tracker_.add(d);
  if (counters_) {
    DispatchRecord rec;
    rec.label = d.label;
    rec.pass = static_cast<uint32_t>(counters_->passes);
    rec.stage = static_cast<uint32_t>(counters_->barrier_stages - 1);
    rec.kernel = d.pipeline->name();
    for (const Range& r : d.reads) {
      rec.bytes_read += r.size;
      rec.reads.emplace_back(r.buffer->label(), r.size);
    }
    for (const Range& r : d.writes) {
      rec.bytes_written += r.size;
      rec.writes.emplace_back(r.buffer->label(), r.size);
    }
    rec.threads = d.threadgroup;
    rec.groups = d.grid_is_threadgroups
                     ? d.grid
                     : Size3{(d.grid.x + d.threadgroup.x - 1) / d.threadgroup.x,
                             (d.grid.y + d.threadgroup.y - 1) / d.threadgroup.y,
                             (d.grid.z + d.threadgroup.z - 1) / d.threadgroup.z};
    for (const Binding& b : d.bindings) {
      if (b.kind == Binding::Kind::threadgroup_memory) rec.threadgroup_memory += b.length;
      if (b.kind == Binding::Kind::bytes) rec.args.emplace_back(b.index, b.bytes);
    }
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

std::string gpu_family_name(int family) { return "apple" + std::to_string(family); }

int parse_gpu_family(const std::string& name) {
  for (int f = 7; f <= 10; ++f)
    if (name == gpu_family_name(f)) return f;
  throw UsageError("gpu_family must be 'apple7', 'apple8', 'apple9' or 'apple10', not '" + name + "'");
}

}  // namespace lily::gpu
