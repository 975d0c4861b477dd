#include "metadata/etcd/etcd_keys.h"

#include "absl/strings/str_cat.h"

namespace ferry::metadata {

namespace {

std::string Escape(const std::string& name) {
  std::string out;
  for (char c : name) {
    if (c == '%') {
      out += "%25";
    } else if (c == '/') {
      out += "%2F";
    } else {
      out += c;
    }
  }
  return out;
}

std::string Unescape(absl::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s.substr(i, 3) == "%25") {
      out += '%';
      i += 2;
    } else if (s.substr(i, 3) == "%2F") {
      out += '/';
      i += 2;
    } else {
      out += s[i];
    }
  }
  return out;
}

}  // namespace

std::string EtcdKeys::OwnerKey(const std::string& name) const {
  return absl::StrCat(prefix_, "owner/", Escape(name));
}
std::string EtcdKeys::MetaKey(const std::string& name) const {
  return absl::StrCat(MetaPrefix(), Escape(name));
}
std::string EtcdKeys::BufPrefix(const std::string& name) const {
  return absl::StrCat(prefix_, "buf/", Escape(name), "/");
}
std::string EtcdKeys::BufKey(const std::string& name, uint64_t addr) const {
  return absl::StrCat(BufPrefix(name), absl::Hex(addr, absl::kZeroPad16));
}

std::string EtcdKeys::MetaPrefix() const {
  return absl::StrCat(prefix_, "meta/");
}

std::string EtcdKeys::NameOfMetaKey(absl::string_view meta_key) const {
  return Unescape(meta_key.substr(MetaPrefix().size()));
}

std::string PrefixEnd(std::string prefix) {
  while (!prefix.empty()) {
    if (static_cast<uint8_t>(prefix.back()) < 0xff) {
      prefix.back() = static_cast<char>(prefix.back() + 1);
      return prefix;
    }
    prefix.pop_back();
  }
  return std::string(1, '\0');  // Every key.
}

}  // namespace ferry::metadata
